"""Client overhead of PDChatClient versus the same two calls written by hand.

Against a real loopback stub of a vLLM P/D pair (tests/stubserver.py, one process for
decode and one prefill process per prompt size, so the stubs never share this process's
GIL), each iteration runs both arms back to back, alternating which goes first:

- ``pdclient``: ``PDChatClient(...).chat.completions.create(stream=True)``, iterated to the end;
- ``baseline``: what a user writes with plain ``openai.OpenAI`` clients (their default
  HTTP client: httpx2 on openai 3.x): a prefill call with ``max_tokens=1`` and
  ``extra_body`` ``return_token_ids`` / ``kv_transfer_params.do_remote_decode``, then a
  streamed decode call whose ``extra_body`` carries the prefill's ``kv_transfer_params``
  plus its ``prompt_token_ids``. Same ``X-Request-Id`` on both legs, as pdclient does.

A third arm, ``signed``, is pdclient with ``reuse_secret`` set (every leg signed for the
server patch's guard). In the same loop, interleaved, the benchmark also times a plain
``orjson.loads`` + ``orjson.dumps`` of the very prefill response body the handoff reads:
the cost of handling the ids as Python objects, with the fastest JSON library there is.

Printed per prompt size: median wall time per call of pdclient and the baseline and their
ratio (target <= 1.05); pdclient's median handoff CPU per call from
``PDTrace.handoff_cpu_ms`` (reading the prefill result and building, and signing, the
decode body; targets at 32k ids: <= 0.3 ms unsigned, <= 0.6 ms signed), the JSON round
trip beside it and the ratio handoff / JSON (target <= 0.3); and each arm's median client
CPU per call (``time.thread_time`` around the whole call: a sync client does all its work,
I/O included, in the calling thread).

A second table measures the client CPU of a non-streamed call that may move to another
decode endpoint if its decode dies (``migrate_non_streamed=True``, ``migration.Assembler``:
its decode leg streams with ``return_token_ids`` and the JSON body is assembled from the
events) against the default non-streamed path (the decode's own JSON passed through), per
answer length, over two decode stubs; printed with the ratio assembled / JSON.

Run: make bench-client-overhead ARGS="--repeat 3"   (python benchmarks/bench_client_overhead.py)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson

from pdclient import PDChatClient, PDTrace

STUB = Path(__file__).resolve().parent.parent / "tests" / "stubserver.py"
MODEL = "stub-model"
PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@contextlib.contextmanager
def stub_process(prompt_tokens: int) -> Iterator[str]:
    """A stub server in its own process; yields its base URL."""
    process = subprocess.Popen(
        [sys.executable, str(STUB), "--prompt-tokens", str(prompt_tokens)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        if not line.startswith("READY "):
            raise RuntimeError(f"stub server did not start: {line!r}")
        yield line.split(" ", 1)[1]
    finally:
        assert process.stdin is not None
        process.stdin.close()  # the stub exits when its stdin closes
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def decode_stub_process(answer_tokens: int) -> Iterator[str]:
    """A decode stub in its own process whose answer has ``answer_tokens`` tokens; yields its base URL."""
    code = (
        "import sys; from tests.stubserver import StubServer; "
        f"server = StubServer(record=False, words=[f' w{{i}}' for i in range({answer_tokens})]).start(); "
        "print('READY', server.url, flush=True); sys.stdin.read(); server.stop()"
    )
    process = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=STUB.parents[1]
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline().strip()
        if not line.startswith("READY "):
            raise RuntimeError(f"decode stub did not start: {line!r}")
        yield line.split(" ", 1)[1]
    finally:
        assert process.stdin is not None
        process.stdin.close()
        process.wait(timeout=10)


def messages_for(prompt_tokens: int, kind: str) -> list[dict[str, str]]:
    """A short question, or a prompt about as long as ``prompt_tokens`` tokens (~4 chars each)."""
    if kind == "short":
        return [{"role": "user", "content": "Summarize the document."}]
    words = "the quick brown fox jumps over a lazy dog while "
    text = (words * (prompt_tokens * 4 // len(words) + 1))[: prompt_tokens * 4]
    return [{"role": "system", "content": "You are concise."}, {"role": "user", "content": text}]


@dataclass
class Arm:
    name: str
    call: Callable[[], int]
    """Runs one full call; returns the prompt tokens the decode reported it was given."""
    wall_ms: list[float] = field(default_factory=list)
    cpu_ms: list[float] = field(default_factory=list)

    def run_once(self, record: bool) -> int:
        wall, cpu = time.perf_counter(), time.thread_time()
        prompt_tokens = self.call()
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
        if record:
            self.wall_ms.append(wall * 1000)
            self.cpu_ms.append(cpu * 1000)
        return prompt_tokens


def usage_prompt_tokens(stream: Any) -> int:
    prompt_tokens = -1
    for chunk in stream:
        if chunk.usage is not None:
            prompt_tokens = chunk.usage.prompt_tokens
    return prompt_tokens


def make_arms(
    prefill_url: str, decode_url: str, messages: Any, traces: list[PDTrace], signed_traces: list[PDTrace]
) -> list[Arm]:
    # Every call a handoff: the same prompt again would go decode-only under the default "auto".
    urls = {"prefill_base_url": prefill_url, "decode_base_url": decode_url, "api_key": "-", "remote_prefill": "always"}
    pd = PDChatClient(**urls, on_trace=traces.append)
    signing = PDChatClient(**urls, on_trace=signed_traces.append, reuse_secret="bench-secret")
    # What a user writes by hand: two plain clients with their default HTTP client.
    prefill = openai.OpenAI(base_url=prefill_url, api_key="-")
    decode = openai.OpenAI(base_url=decode_url, api_key="-")
    stream_options: Any = {"include_usage": True}  # the decode reports how many ids it was given

    def pdclient_call(client: PDChatClient = pd) -> int:
        stream = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            stream_options=stream_options,
        )
        return usage_prompt_tokens(stream)

    def baseline_call() -> int:
        headers = {"X-Request-Id": f"bench-{uuid.uuid4().hex}"}
        first = prefill.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=1,
            extra_headers=headers,
            extra_body={"return_token_ids": True, "kv_transfer_params": PREFILL_KV_PARAMS},
        )
        extra = first.model_extra or {}
        kv_params = {**(extra.get("kv_transfer_params") or {}), "prompt_token_ids": extra["prompt_token_ids"]}
        stream = decode.chat.completions.create(
            model=MODEL,
            messages=messages,
            stream=True,
            stream_options=stream_options,
            extra_headers=headers,
            extra_body={"kv_transfer_params": kv_params},
        )
        return usage_prompt_tokens(stream)

    return [
        Arm("pdclient", pdclient_call),
        Arm("baseline", baseline_call),
        Arm("signed", lambda: pdclient_call(signing)),
    ]


def prefill_response_body(prefill_url: str, messages: Any) -> bytes:
    """The bytes a prefill answers with: what the handoff reads, and the JSON arm round-trips."""
    body = {"model": MODEL, "messages": messages, "max_tokens": 1, "return_token_ids": True}
    response = httpx.post(f"{prefill_url}/chat/completions", json={**body, "kv_transfer_params": PREFILL_KV_PARAMS})
    response.raise_for_status()
    return response.content


def json_round_trip_ms(body: bytes) -> float:
    start = time.thread_time()
    orjson.dumps(orjson.loads(body))
    return (time.thread_time() - start) * 1000


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def bench_size(
    prefill_url: str, decode_url: str, prompt_tokens: int, kind: str, iterations: int, warmup: int
) -> dict[str, Any]:
    traces: list[PDTrace] = []
    signed_traces: list[PDTrace] = []
    messages = messages_for(prompt_tokens, kind)
    arms = make_arms(prefill_url, decode_url, messages, traces, signed_traces)
    prefill_body = prefill_response_body(prefill_url, messages)
    json_ms: list[float] = []
    for _ in range(warmup):
        for arm in arms:
            got = arm.run_once(record=False)
            if got != prompt_tokens:
                raise RuntimeError(f"{arm.name}: decode was given {got} prompt ids, expected {prompt_tokens}")
    traces.clear()
    signed_traces.clear()
    for i in range(iterations):
        for arm in arms if i % 2 == 0 else arms[::-1]:  # neither arm always goes first
            arm.run_once(record=True)
        json_ms.append(json_round_trip_ms(prefill_body))
    pd, base, _ = arms
    handoff = [t.handoff_cpu_ms for t in traces if t.handoff_cpu_ms is not None]
    signed = [t.handoff_cpu_ms for t in signed_traces if t.handoff_cpu_ms is not None]
    assert len(handoff) == len(signed) == iterations
    assert all(t.forwarded_tokens == prompt_tokens for t in (*traces, *signed_traces))
    paired = [a / b for a, b in zip(pd.wall_ms, base.wall_ms, strict=True)]
    return {
        "size": prompt_tokens,
        "messages": kind,
        "pd_ms": median(pd.wall_ms),
        "base_ms": median(base.wall_ms),
        "ratio": median(pd.wall_ms) / median(base.wall_ms),
        "paired_ratio": median(paired),
        "handoff_ms": median(handoff),
        "handoff_p90_ms": statistics.quantiles(handoff, n=10)[-1],
        "signed_ms": median(signed),
        "json_ms": median(json_ms),
        "handoff_json_ratio": median(handoff) / median(json_ms),
        "pd_cpu_ms": median(pd.cpu_ms),
        "base_cpu_ms": median(base.cpu_ms),
    }


def bench_non_streamed(
    prefill_url: str, decode_urls: list[str], answer_tokens: int, iterations: int, warmup: int
) -> dict[str, Any]:
    """Client CPU and wall time of a non-streamed call: assembled from a stream (it may move) or the JSON as today."""
    messages = messages_for(0, "short")
    urls: Any = {"prefill_base_url": prefill_url, "decode_base_url": decode_urls, "api_key": "-"}
    urls["remote_prefill"] = "always"
    assembling = PDChatClient(**urls, migrate_non_streamed=True)
    passing = PDChatClient(**urls)  # the default

    def call(client: PDChatClient) -> int:
        answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=answer_tokens + 8)
        assert answer.usage is not None and answer.choices[0].message.content
        return answer.usage.completion_tokens

    arms = [Arm("assembled", lambda: call(assembling)), Arm("json", lambda: call(passing))]
    for _ in range(warmup):
        for arm in arms:
            arm.run_once(record=False)
    for i in range(iterations):
        for arm in arms if i % 2 == 0 else arms[::-1]:
            arm.run_once(record=True)
    assembled, passed = arms
    assembling.close()
    passing.close()
    return {
        "tokens": answer_tokens,
        "assembled_cpu_ms": median(assembled.cpu_ms),
        "json_cpu_ms": median(passed.cpu_ms),
        "cpu_ratio": median(assembled.cpu_ms) / median(passed.cpu_ms),
        "assembled_ms": median(assembled.wall_ms),
        "json_ms": median(passed.wall_ms),
        "added_cpu_us_per_token": (median(assembled.cpu_ms) - median(passed.cpu_ms)) * 1000 / answer_tokens,
    }


def print_non_streamed(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'answer tokens':>13} | {'client CPU ms/call: assembled':>29} {'JSON':>6} {'ratio':>6} "
        f"{'added us/token':>14} | {'wall ms: assembled':>18} {'JSON':>6}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['tokens']:>13} | {r['assembled_cpu_ms']:>29.2f} {r['json_cpu_ms']:>6.2f} {r['cpu_ratio']:>6.2f} "
            f"{r['added_cpu_us_per_token']:>14.1f} | {r['assembled_ms']:>18.2f} {r['json_ms']:>6.2f}"
        )


def median_over(runs: list[list[dict[str, Any]]], i: int) -> dict[str, float]:
    """Row ``i``'s measured columns, each the median over the runs."""
    first = runs[0][i]
    return {k: statistics.median(run[i][k] for run in runs) for k in first if isinstance(first[k], float)}


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'ids':>6} {'messages':>8} | {'pdclient ms':>11} {'baseline ms':>11} {'ratio':>6} {'paired':>6} | "
        f"{'handoff CPU ms':>14} {'p90':>5} {'signed':>6} | {'JSON ms':>7} {'handoff/JSON':>12} | "
        f"{'client CPU ms/call: pd':>22} {'baseline':>8}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['size']:>6} {r['messages']:>8} | {r['pd_ms']:>11.2f} {r['base_ms']:>11.2f} {r['ratio']:>6.3f} "
            f"{r['paired_ratio']:>6.3f} | {r['handoff_ms']:>14.3f} {r['handoff_p90_ms']:>5.2f} "
            f"{r['signed_ms']:>6.3f} | {r['json_ms']:>7.3f} {r['handoff_json_ratio']:>12.3f} | "
            f"{r['pd_cpu_ms']:>22.2f} {r['base_cpu_ms']:>8.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iterations", type=int, default=200, help="measured calls per arm per row")
    parser.add_argument("--warmup", type=int, default=20, help="unmeasured calls per arm per row")
    parser.add_argument("--repeat", type=int, default=1, help="runs of the whole table; prints their medians")
    parser.add_argument("--sizes", default="8192,32768", help="prompt ids the prefill answers with")
    parser.add_argument(
        "--answer-tokens",
        default="16,256",
        help="non-streamed table: answer lengths (tokens) of the decode stubs; empty: skip the table",
    )
    parser.add_argument(
        "--messages",
        choices=("short", "long", "both"),
        default="both",
        help="short: a one-line question; long: a prompt of about as many tokens as ids (both arms send it twice)",
    )
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = ["short", "long"] if args.messages == "both" else [args.messages]

    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("openai", "httpx", "httpx2", "orjson"))
    print(f"python {platform.python_version()}, {versions}, {os.cpu_count()} CPUs")
    print(
        f"{args.iterations} calls per arm per row after {args.warmup} warm-up, interleaved; "
        "baseline = plain openai.OpenAI, default HTTP client"
    )
    runs: list[list[dict[str, Any]]] = []
    with contextlib.ExitStack() as stack:
        decode_url = stack.enter_context(stub_process(16))
        prefill_urls = {size: stack.enter_context(stub_process(size)) for size in sizes}
        for run in range(args.repeat):
            rows = [
                bench_size(prefill_urls[size], decode_url, size, kind, args.iterations, args.warmup)
                for size in sizes
                for kind in kinds
            ]
            runs.append(rows)
            print(f"\nrun {run + 1} of {args.repeat}, load average {os.getloadavg()[0]:.1f}")
            print_table(rows)
        answers = [int(n) for n in args.answer_tokens.split(",") if n]
        decodes = {n: [stack.enter_context(decode_stub_process(n)) for _ in range(2)] for n in answers}
        non_streamed: list[list[dict[str, Any]]] = []
        for run in range(args.repeat if answers else 0):
            rows = [
                bench_non_streamed(prefill_urls[sizes[0]], decodes[n], n, args.iterations, args.warmup) for n in answers
            ]
            non_streamed.append(rows)
            load = os.getloadavg()[0]
            print(f"\nnon-streamed, run {run + 1} of {args.repeat}, {sizes[0]} prompt ids, load average {load:.1f}")
            print_non_streamed(rows)
    if len(runs) > 1:
        print(f"\nmedian of each column over the {len(runs)} runs")
        print_table([{**row, **median_over(runs, i)} for i, row in enumerate(runs[0])])
    if len(non_streamed) > 1:
        print(f"\nnon-streamed: median of each column over the {len(non_streamed)} runs")
        print_non_streamed([{**row, **median_over(non_streamed, i)} for i, row in enumerate(non_streamed[0])])
    print()
    print("ratio = median pdclient / median baseline (target <= 1.05); paired = median of per-iteration ratios")
    print(
        "handoff CPU = PDTrace.handoff_cpu_ms: read the prefill result + build the decode body "
        "(targets at 32k: <= 0.3 ms; signed <= 0.6 ms)"
    )
    print(
        "JSON = orjson.loads + orjson.dumps of the same prefill response body, in the same loop; "
        "handoff/JSON target <= 0.3"
    )
    print("client CPU = thread_time per whole call (the least load-sensitive column on a busy machine)")
    print(
        "non-streamed: assembled = the decode leg streamed (return_token_ids, include_usage) and the JSON body "
        "assembled, so the call may move (migrate_non_streamed=True); JSON = the decode's own JSON passed through "
        "(the default)"
    )


if __name__ == "__main__":
    main()
