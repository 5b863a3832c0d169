"""`pdclient serve`'s own CPU per call, in process, against another git revision's.

    python benchmarks/bench_serve_cpu.py --against a085222     # this checkout vs a085222
    python benchmarks/bench_serve_cpu.py --against ../main     # vs another checkout, as it is

What the proxy's Python costs per call, without the noise a loaded machine puts on a
latency benchmark: each tree's app (``create_app``, its metrics and its INFO log line
included, the log written to /dev/null) is driven at the ASGI level in its own process,
its legs answered from memory by a transport that returns a canned vLLM prefill (1536
ids, NIXL ``kv_transfer_params``) and a canned 8-token SSE decode. No sockets, no uvicorn,
no aiohttp: those cost the same for either tree, and ``bench_proxies.py stubs`` measures
them. The two processes run their rounds in turn, interleaved, so both see the same
machine, pinned to one core (on a shared VM, two cores can differ by a third); CPU is
``time.process_time`` per round. Printed: each tree's median us per call
over the rounds, and the ratio this checkout / the other (below 1: this one is cheaper).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import logging.config
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
IDS = list(range(1, 1537))


def _child(calls: int, cpu: int) -> None:
    """One tree's app (pdclient imported from the working directory), a round per line on stdin."""
    os.sched_setaffinity(0, {cpu})
    sys.path.insert(0, os.getcwd())
    import httpx
    import orjson

    import pdclient
    from pdclient.serve import ServeConfig, create_app
    from pdclient.serve._logging import logging_config

    logging.config.dictConfig(logging_config("text", "info"))
    for handler in logging.getLogger("pdclient").handlers:
        handler.stream = open(os.devnull, "w")  # type: ignore[attr-defined]  # noqa: SIM115

    kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e", "remote_block_ids": [1, 2]}
    prefill = orjson.dumps(
        {
            "id": "p", "object": "chat.completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(IDS), "completion_tokens": 1, "total_tokens": len(IDS) + 1},
            "prompt_token_ids": IDS, "kv_transfer_params": {**kv, "remote_host": "h", "remote_port": 1},
        }
    )  # fmt: skip
    delta = {"id": "d", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    events = [
        b"data: " + orjson.dumps({**delta, "choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}) + b"\n\n"
        for i in range(8)
    ] + [b"data: [DONE]\n\n"]

    class Events(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for event in events:
                yield event

    class Legs(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if b'"do_remote_decode":true' in request.content:
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(prefill)).encode())]
                return httpx.Response(200, headers=headers, stream=httpx.ByteStream(prefill))
            return httpx.Response(200, headers=[(b"content-type", b"text/event-stream")], stream=Events())

    config = ServeConfig.from_mapping(
        {"prefill": ["http://p:1/v1"], "decode": ["http://d:2/v1"], "remote_prefill": "always"}
    )
    app = create_app(config, leg_transport=Legs())
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hello " * 1500}], "max_tokens": 8, "stream": True}
    ).encode()
    headers = [
        (b"host", b"127.0.0.1:9"), (b"accept", b"*/*"), (b"accept-encoding", b"gzip, deflate"),
        (b"connection", b"keep-alive"), (b"user-agent", b"python-httpx/0.28.1"),
        (b"content-length", str(len(body)).encode()), (b"content-type", b"application/json"),
    ]  # fmt: skip
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
        "headers": headers, "server": ("127.0.0.1", 9), "client": ("127.0.0.1", 5),
    }  # fmt: skip

    async def one_call() -> None:
        requested = False
        never = asyncio.Event()
        statuses: list[int] = []

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await never.wait()  # the caller stays: no disconnect
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await app(dict(scope), receive, send)
        if statuses != [200]:
            raise RuntimeError(f"the app answered {statuses}")

    async def rounds() -> None:
        for _ in range(300):  # warm-up: imports, caches, pools
            await one_call()
        print("ready", Path(pdclient.__file__).parent.parent, flush=True)
        for _ in sys.stdin:
            started = time.process_time()
            for _ in range(calls):
                await one_call()
            print((time.process_time() - started) / calls * 1e6, flush=True)

    asyncio.run(rounds())


@contextlib.contextmanager
def worktree(revision: str) -> Iterator[Path]:
    """``revision`` checked out in a temporary worktree."""
    with tempfile.TemporaryDirectory(prefix="pdclient-bench-") as scratch:
        path = Path(scratch) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "-q", "--detach", str(path), revision], check=True)
        try:
            yield path
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(path)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--against",
        required=True,
        help="the git revision to compare with (a commit, a tag, main), or a checkout's directory",
    )
    parser.add_argument("--calls", type=int, default=2000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cpu", type=int, default=max(os.sched_getaffinity(0)), help="the core both apps run on")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.calls, args.cpu)
        return
    given = Path(args.against)
    checkout = contextlib.nullcontext(given.resolve()) if given.is_dir() else worktree(args.against)
    with checkout as other:
        trees = {"this checkout": REPO, args.against: other}
        child_args = ["--child", "--calls", str(args.calls), "--cpu", str(args.cpu), "--against", "-"]
        command = [sys.executable, str(Path(__file__).resolve()), *child_args]
        children = {
            name: subprocess.Popen(command, cwd=tree, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            for name, tree in trees.items()
        }
        try:
            for name, child in children.items():
                ready = child.stdout.readline().split() if child.stdout is not None else []
                if ready != ["ready", str(trees[name])]:  # and pdclient imported from its own tree
                    raise SystemExit(f"{name}: the app did not start from {trees[name]} ({ready})")
            per_call: dict[str, list[float]] = {name: [] for name in children}
            for round_number in range(args.rounds):
                order = list(children) if round_number % 2 == 0 else list(reversed(children))
                for name in order:
                    child = children[name]
                    assert child.stdin is not None and child.stdout is not None
                    child.stdin.write("\n")
                    child.stdin.flush()
                    per_call[name].append(float(child.stdout.readline()))
                print(f"round {round_number + 1}: " + ", ".join(f"{n} {v[-1]:.0f} us" for n, v in per_call.items()))
        finally:
            for child in children.values():
                if child.stdin is not None:
                    child.stdin.close()
                child.wait(30)
    medians = {name: statistics.median(values) for name, values in per_call.items()}
    print(f"\nCPU per call, median of {args.rounds} rounds of {args.calls} calls (in process, legs in memory):")
    for name, median in medians.items():
        print(f"  {name:<16} {median:7.0f} us   (min {min(per_call[name]):.0f}, max {max(per_call[name]):.0f})")
    ratios = [mine / theirs for mine, theirs in zip(per_call["this checkout"], per_call[args.against], strict=True)]
    print(f"  this checkout / {args.against}: {statistics.median(ratios):.2f} (median of the rounds' ratios)")


if __name__ == "__main__":
    main()
