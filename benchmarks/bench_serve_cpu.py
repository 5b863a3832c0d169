"""`pdclient serve`'s own CPU per call, in process, against another git revision's.

    python benchmarks/bench_serve_cpu.py --against a085222     # this checkout vs a085222
    python benchmarks/bench_serve_cpu.py --against ../main     # vs another checkout, as it is
    python benchmarks/bench_serve_cpu.py --against HEAD --workload conversations   # auto's own work

What the proxy's Python costs per call, without the noise a loaded machine puts on a
latency benchmark: each tree's app (``create_app``, its metrics and its INFO log line
included, the log written to /dev/null) is driven at the ASGI level in its own process,
its legs answered from memory by a transport that returns a canned vLLM prefill (1536
ids, NIXL ``kv_transfer_params``) and a canned 8-token SSE decode. No sockets, no uvicorn,
no aiohttp: those cost the same for either tree, and ``bench_proxies.py stubs`` measures
them. The two processes run their rounds in turn, interleaved, so both see the same
machine, pinned to one core (on a shared VM, two cores can differ by a third); CPU is
``time.process_time`` per round. Printed: each tree's median us per call
over the rounds, and the ratio this checkout / the other (below 1: this one is cheaper),
and the requests the legs saw per call (the same in both: the same decisions).

``--workload conversations`` measures what ``remote_prefill="auto"`` adds: multi-turn
calls (``CONVERSATIONS`` conversations of ``TURNS`` turns, taken in turn), 40-token answers
with their finish and usage, and legs that answer a prefill after 100 ms and a decode-only
decode after 5 ms (asleep), so that ``auto`` hands off each first turn and learns to send
the follow-ups decode-only, each with its warm-up to the prefill: the conversation memory,
the answer's read-back, the cost model and the warm-ups are all on the path.
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
ANSWER_TOKENS = 40
"""The answer of a ``conversations`` call: vLLM's multi-turn benchmark's ~40 tokens."""
CONVERSATIONS, TURNS = 8, 4
USER_WORDS = 30
PREFILL_S, DECODE_ONLY_S = 0.1, 0.005
"""A ``conversations`` call's prefill leg answers after 100 ms, a decode-only call's decode
after 5 ms (asleep: no CPU): ``auto`` learns that a follow-up is faster decode-only, as on
the real pair, and sends the follow-ups there (and their warm-ups to the prefill)."""


def _child(calls: int, cpu: int, workload: str) -> None:
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

    conversations = workload == "conversations"
    kv = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "e", "remote_block_ids": [1, 2]}

    def one_token_answer(usage: dict[str, Any], **fields: object) -> bytes:
        return orjson.dumps(
            {
                "id": "p", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}],
                "usage": {**usage, "completion_tokens": 1, "total_tokens": usage["prompt_tokens"] + 1}, **fields,
            }
        )  # fmt: skip

    def prefill_answer(ids: list[int]) -> bytes:
        kv_params = {**kv, "remote_host": "h", "remote_port": 1}
        return one_token_answer({"prompt_tokens": len(ids)}, prompt_token_ids=ids, kv_transfer_params=kv_params)

    prefills: dict[int, bytes] = {}
    warmed = one_token_answer({"prompt_tokens": 900, "prompt_tokens_details": {"cached_tokens": 768}})

    def prefill_for(content: bytes) -> bytes:
        """The one prompt's answer; a conversation's with a token per 4 bytes of its body (as
        text reads), so the estimates learn what they would from a server."""
        count = len(content) // 4 if conversations else len(IDS)
        if count not in prefills:
            prefills[count] = prefill_answer(list(range(1, count + 1)))
        return prefills[count]

    delta = {"id": "d", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    tokens = ANSWER_TOKENS if conversations else 8
    events = [
        b"data: " + orjson.dumps({**delta, "choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}) + b"\n\n"
        for i in range(tokens)
    ]
    if conversations:  # an answer as vLLM ends it: its finish, then the usage pdclient asks for
        finish = {"index": 0, "delta": {}, "finish_reason": "length"}
        usage = {"prompt_tokens": len(IDS), "completion_tokens": tokens, "total_tokens": len(IDS) + tokens}
        events.append(b"data: " + orjson.dumps({**delta, "choices": [finish]}) + b"\n\n")
        events.append(b"data: " + orjson.dumps({**delta, "choices": [], "usage": usage}) + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    answer = "".join(f"w{i} " for i in range(tokens))
    seen = {"prefill": 0, "decode": 0, "other": 0}

    class Events(httpx.AsyncByteStream):
        async def __aiter__(self) -> AsyncIterator[bytes]:
            for event in events:
                yield event

    class Legs(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            content = await request.aread()
            handed_off = b'"do_remote_prefill":true' in content
            if b'"do_remote_decode":true' in content or b'"stream":true' not in content:  # a warm-up too
                prefilling = b'"do_remote_decode":true' in content
                seen["prefill" if prefilling else "other"] += 1
                if conversations and prefilling:
                    await asyncio.sleep(PREFILL_S)
                prefill = prefill_for(content) if prefilling else warmed
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(prefill)).encode())]
                return httpx.Response(200, headers=headers, stream=httpx.ByteStream(prefill))
            seen["decode"] += 1
            if conversations and not handed_off:
                await asyncio.sleep(DECODE_ONLY_S)
            return httpx.Response(200, headers=[(b"content-type", b"text/event-stream")], stream=Events())

    config = ServeConfig.from_mapping(
        {
            "prefill": ["http://p:1/v1"],
            "decode": ["http://d:2/v1"],
            "remote_prefill": "auto" if conversations else "always",
        }
    )
    app = create_app(config, leg_transport=Legs())
    one_prompt = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hello " * 1500}], "max_tokens": 8, "stream": True}
    ).encode()
    histories: list[list[dict[str, str]]] = []
    started_conversations = 0

    def next_body() -> bytes:
        """The one prompt; or the next turn of one of ``CONVERSATIONS`` conversations in
        turn, each ``TURNS`` turns long and then begun anew (a new prefix: a new one)."""
        nonlocal started_conversations
        if not conversations:
            return one_prompt
        if len(histories) < CONVERSATIONS:
            histories.append([])
        history = histories.pop(0)
        if len(history) >= 2 * TURNS + 1:
            history = []
        if not history:
            started_conversations += 1
            history.append({"role": "system", "content": f"conversation {started_conversations}: " + "word " * 600})
        else:
            history.append({"role": "assistant", "content": answer})
        history.append({"role": "user", "content": f"turn {len(history)}: " + "more " * USER_WORDS})
        histories.append(history)
        return json.dumps({"model": "m", "messages": history, "max_tokens": tokens, "stream": True}).encode()

    headers = [
        (b"host", b"127.0.0.1:9"), (b"accept", b"*/*"), (b"accept-encoding", b"gzip, deflate"),
        (b"connection", b"keep-alive"), (b"user-agent", b"python-httpx/0.28.1"),
        (b"content-length", b"0"), (b"content-type", b"application/json"),  # its length: per call
    ]  # fmt: skip
    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
        "headers": headers, "server": ("127.0.0.1", 9), "client": ("127.0.0.1", 5),
    }  # fmt: skip

    async def one_call() -> None:
        body = next_body()
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

        headers = [
            (b"content-length", str(len(body)).encode()) if k == b"content-length" else (k, v)
            for k, v in scope["headers"]
        ]
        await app({**scope, "headers": headers}, receive, send)
        if statuses != [200]:
            raise RuntimeError(f"the app answered {statuses}")

    async def rounds() -> None:
        for _ in range(300):  # warm-up: imports, caches, pools
            await one_call()
        print("ready", Path(pdclient.__file__).parent.parent, flush=True)
        for _ in sys.stdin:
            before = dict(seen)
            started = time.process_time()
            for _ in range(calls):
                await one_call()
            await asyncio.sleep(0)  # the warm-ups' driver posts what the last calls queued
            legs = {name: (seen[name] - before[name]) / calls for name in seen}
            print(json.dumps({"us": (time.process_time() - started) / calls * 1e6, "legs": legs}), flush=True)

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
    parser.add_argument(
        "--workload",
        choices=("one-prompt", "conversations"),
        default="one-prompt",
        help="one-prompt: one ~1.5k-token prompt, always P/D, 8-token answers; conversations: "
        f"{CONVERSATIONS} conversations of {TURNS} turns in turn (a ~600-word prefix, {USER_WORDS}-word turns), "
        f"--remote-prefill auto, {ANSWER_TOKENS}-token answers with their finish and usage",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(args.calls, args.cpu, args.workload)
        return
    given = Path(args.against)
    checkout = contextlib.nullcontext(given.resolve()) if given.is_dir() else worktree(args.against)
    with checkout as other:
        trees = {"this checkout": REPO, args.against: other}
        child_args = ["--child", "--calls", str(args.calls), "--cpu", str(args.cpu), "--against", "-"]
        child_args += ["--workload", args.workload]
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
            legs: dict[str, dict[str, float]] = {}
            for round_number in range(args.rounds):
                order = list(children) if round_number % 2 == 0 else list(reversed(children))
                for name in order:
                    child = children[name]
                    assert child.stdin is not None and child.stdout is not None
                    child.stdin.write("\n")
                    child.stdin.flush()
                    result = json.loads(child.stdout.readline())
                    per_call[name].append(result["us"])
                    legs[name] = result["legs"]
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
    print("Requests the legs saw per call, last round (prefill, decode, other: warm-ups):")
    for name, seen in legs.items():
        print(f"  {name:<16} " + ", ".join(f"{kind} {count:.2f}" for kind, count in seen.items()))
    ratios = [mine / theirs for mine, theirs in zip(per_call["this checkout"], per_call[args.against], strict=True)]
    print(f"  this checkout / {args.against}: {statistics.median(ratios):.2f} (median of the rounds' ratios)")


if __name__ == "__main__":
    main()
