"""Decode migration: the caller's pause at a cut, against what a full retry costs it.

    python benchmarks/bench_migration.py --rounds 6                           # a trio of its own, ~20 min
    python benchmarks/bench_migration.py --chunk-cost                          # per-chunk CPU only, no servers

A LocalPD pair (prefill P, decode D1) plus a second decode server D2
(tests/pair/extra_decode.py). Each round, one streamed greedy call (``ignore_eos``, so the
answer has ``--tokens`` tokens) starts on D2; once the caller holds ``--cut`` tokens, D2's
process group is SIGKILLed (tokens, not chunks: vLLM's API server merges the deltas of a
stream it is behind on into one chunk, and on a fast CPU 48 chunks can be a whole answer).
The arms alternate round by round:

- ``migrate`` (``max_decode_migrations=1``): the stream goes on from D1. Its cost is the
  caller's pause: from the last chunk before the cut to the first chunk after it, on the
  caller's clock (and ``PDTrace.migrations[0].pause_ms``, pdclient's own clock).
- ``retry`` (``max_decode_migrations=0``): the call fails; the caller sends it again (a new
  prefill, the decode on D1) and reads until the first token past what it had shown. Its
  cost is from the last chunk before the cut to that chunk.

D2 is started again after each round (not timed). Printed: each round, the medians of
both arms and their ratio (target: the pause at most a third of the retry). Written:
every sample as JSON and a PNG (matplotlib, in the frameworks venv).
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import openai

if __package__ in (None, ""):  # run as a script: the checkout's tests/ is importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pdclient import PDChatClient, PDTrace, RouteRequest
from pdclient.local import LocalPD
from tests.pair.extra_decode import TOOL_ARGS, ExtraDecode

RESULTS = Path(__file__).parent / "results"
PROMPT = "Write a long story about a lighthouse keeper and a storm. Round {round}."


@dataclass
class Sample:
    round: int
    arm: str
    cut_after: int
    """Tokens the caller had when the stream broke."""
    cost_ms: float
    """migrate: the pause at the cut; retry: last chunk before the cut to the first new one after it."""
    trace_pause_ms: float | None
    tokens: int
    route: str | None


class Prefer:
    def __init__(self, url: str) -> None:
        self.url = url

    def choose(self, endpoints: Sequence[Any], request: RouteRequest) -> Any:
        return next((e for e in endpoints if e.url == self.url), endpoints[0])


def body(round_: int, tokens: int) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": PROMPT.format(round=round_)}],
        "temperature": 0,
        "max_tokens": tokens,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }


def token_times(
    stream: Any, times: list[float], *, kill: ExtraDecode | None = None, cut: int = 0, until: int | None = None
) -> None:
    """Read ``stream``, noting when each token arrived (a chunk's tokens at its time).

    ``kill``: SIGKILL that server once ``cut`` tokens are in. ``until``: stop reading there.
    """
    for chunk in stream:
        ids = (chunk.choices[0].model_extra or {}).get("token_ids") if chunk.choices else None
        if not ids:
            continue
        times += [time.perf_counter()] * len(ids)
        if kill is not None and len(times) >= cut:
            kill.kill()
            kill = None
        if until is not None and len(times) >= until:
            return


def one_round(round_: int, arm: str, pd: LocalPD, d2: ExtraDecode, args: argparse.Namespace) -> Sample:
    traces: list[PDTrace] = []
    client = PDChatClient(
        prefill_base_url=pd.prefill_url,
        decode_base_url=[d2.url, pd.decode_url],
        routing=Prefer(d2.url),
        remote_prefill="always",
        api_key="-",
        max_retries=0,
        timeout=600,
        max_decode_migrations=1 if arm == "migrate" else 0,
        on_trace=traces.append,
    )
    request = body(round_, args.tokens)
    times: list[float] = []
    with client:
        if arm == "migrate":
            stream = client.chat.completions.create(model=pd.model, stream=True, **request)
            token_times(stream, times, kill=d2, cut=args.cut)
            (moved,) = traces[0].migrations
            # The cut is where the largest gap is, from the kill on (tokens already on their way still arrive).
            gaps = [(b - a, i) for i, (a, b) in enumerate(itertools.pairwise(times), start=1) if i >= args.cut - 1]
            gap, index = max(gaps)
            return Sample(round_, arm, index, gap * 1000, moved.pause_ms, len(times), moved.route)
        try:
            stream = client.chat.completions.create(model=pd.model, stream=True, **request)
            token_times(stream, times, kill=d2, cut=args.cut)
            raise RuntimeError("the stream did not break")
        except openai.APIConnectionError:
            pass
        shown, last = len(times), times[-1]
        again: list[float] = []
        token_times(client.chat.completions.create(model=pd.model, stream=True, **request), again, until=shown + 1)
        return Sample(round_, arm, shown, (again[-1] - last) * 1000, None, shown, None)


def chunk_cost(events: int = 200_000) -> None:
    """Client CPU per SSE event: a call that may move (tracked) against one that may not."""
    from pdclient.migration import Tracker

    event = (
        b'data: {"id":"chatcmpl-8c1d2e3f4a5b6c7d","object":"chat.completion.chunk","created":1764560000,'
        b'"model":"smollm2","choices":[{"index":0,"delta":{"content":" word"},"logprobs":null,'
        b'"finish_reason":null,"token_ids":[12345]}]}\n\n'
    )
    plain = event.replace(b',"token_ids":[12345]', b"")
    rows = []
    for name, tracker, data in (
        ("tracked, ids stripped", Tracker(chat=True, keep_ids=False, want_prompt_ids=False), event),
        ("tracked, caller's ids kept", Tracker(chat=True, keep_ids=True, want_prompt_ids=False), event),
    ):
        runs = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(events):
                tracker.feed(data)
            runs.append((time.perf_counter() - started) / events * 1e6)
        rows.append((name, statistics.median(runs)))
    started = time.perf_counter()
    for _ in range(events):
        _ = b"data: [DONE]" in plain[-32:]
    rows.append(("not tracked (what DecodeStream does)", (time.perf_counter() - started) / events * 1e6))
    for ids in (8192, 32768):
        # vLLM's first chunk carries the prompt's ids when token ids are asked for: cut out unparsed.
        first = (
            b'data: {"id":"chatcmpl-8c1d2e3f4a5b6c7d","object":"chat.completion.chunk","created":1764560000,'
            b'"model":"smollm2","choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
            b'"finish_reason":null}],"prompt_token_ids":'
            + json.dumps([(i * 2_654_435_761) % 151_000 for i in range(ids)], separators=(",", ":")).encode()
            + b"}\n\n"
        )
        runs = []
        for _ in range(50):
            tracker = Tracker(chat=True, keep_ids=False, want_prompt_ids=False)
            started = time.perf_counter()
            tracker.feed(first)
            runs.append((time.perf_counter() - started) * 1e6)
        rows.append((f"the first chunk, with {ids} prompt ids ({len(first) // 1024} KB)", statistics.median(runs)))
    print("| per SSE event | client CPU µs (median) |\n|---|---:|")
    for name, micros in rows:
        print(f"| {name} | {micros:.2f} |")


def summary(samples: Sequence[Sample]) -> str:
    medians = {arm: statistics.median(s.cost_ms for s in samples if s.arm == arm) for arm in ("migrate", "retry")}
    lines = [
        "| arm | rounds | caller's cost at the cut, median ms (min-max) |",
        "|---|---:|---:|",
    ]
    for arm, label in (("migrate", "migrate (pause)"), ("retry", "full retry (to the first new chunk)")):
        costs = [s.cost_ms for s in samples if s.arm == arm]
        lines.append(f"| {label} | {len(costs)} | {medians[arm]:.0f} ({min(costs):.0f}-{max(costs):.0f}) |")
    ratio = medians["migrate"] / medians["retry"]
    traced = [s.trace_pause_ms for s in samples if s.trace_pause_ms is not None]
    lines.append("")
    lines.append(f"ratio migrate / retry: {ratio:.3f} (target <= 0.333: {'met' if ratio <= 1 / 3 else 'NOT met'})")
    if traced:
        lines.append(f"PDTrace pause_ms median: {statistics.median(traced):.0f}")
    return "\n".join(lines)


def plot(samples: Sequence[Sample], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    figure, axis = plt.subplots(figsize=(6.4, 3.6))
    for position, arm in enumerate(("migrate", "retry")):
        costs = [s.cost_ms / 1000 for s in samples if s.arm == arm]
        axis.scatter([position] * len(costs), costs, alpha=0.7)
        axis.hlines(statistics.median(costs), position - 0.25, position + 0.25, color="black")
        axis.annotate(f"median {statistics.median(costs):.2f} s", (position + 0.28, statistics.median(costs)))
    axis.set_xticks([0, 1], ["migrate (pause at the cut)", "full retry (to the first new chunk)"])
    axis.set_xlim(-0.6, 1.9)
    axis.set_ylabel("caller's cost at the cut, s")
    axis.set_title("A decode server SIGKILLed mid-answer (SmolLM2, vLLM CPU)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    return f"plot: {path}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per arm (each kills a server)")
    parser.add_argument("--tokens", type=int, default=128, help="answer length (ignore_eos)")
    parser.add_argument("--cut", type=int, default=48, help="tokens the caller has when the server dies")
    parser.add_argument("--out", type=Path, default=RESULTS / "migration", help="JSON and PNG path, without suffix")
    parser.add_argument("--chunk-cost", action="store_true", help="only the per-chunk CPU cost (no servers)")
    args = parser.parse_args(argv)
    if args.chunk_cost:
        chunk_cost()
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    samples: list[Sample] = []
    with LocalPD(extra_server_args=TOOL_ARGS) as pd:
        d2 = ExtraDecode.beside(pd.prefill_url, pd)
        try:
            for round_ in range(2 * args.rounds):
                d2.ensure_running()
                arm = ("migrate", "retry")[round_ % 2]
                sample = one_round(round_, arm, pd, d2, args)
                samples.append(sample)
                print(
                    f"round {round_:2d} {arm:8s} cut after {sample.cut_after:3d}: {sample.cost_ms:8.0f} ms", flush=True
                )
        finally:
            d2.stop()
    print()
    print(summary(samples))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps([asdict(s) for s in samples], indent=1))
    print(plot(samples, args.out.with_suffix(".png")))


if __name__ == "__main__":
    main()
