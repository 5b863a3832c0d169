"""`pdclient bench`: time to first token on your own P/D pair, with and without forwarded ids.

    pdclient bench --prefill http://p:8100/v1 --decode http://d:8200/v1 --sizes 1000,4000 --pairs 30
    pdclient bench --local --sizes 1000,4000,7500          # on a LocalPD pair started for it

Both arms run the same PDChatClient handoff (prefill leg, then a streamed decode leg that
pulls the KV); the only difference is that the "no ids" arm sends the per-call option
``forward_ids: false``, so the decode body carries no ``prompt_token_ids`` and the decode
server renders and tokenizes the prompt itself. Calls alternate between the arms (ids first in even
pairs, last in odd ones), and every call has its own prompt, so neither server's prefix
cache hides work.

Per call it records the decode time to first byte (``PDTrace.decode_first_byte_ms``: from
sending the decode request, body built, to the first byte of its stream) and the client
time to first token (from ``create()`` to the first content chunk). It prints medians, the
10-90 % spread and a bootstrap 95 % interval of the paired saving, and writes a PNG plot.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._trace import PDTrace
from ._common import CLIError, add_pair_arguments, open_client

ARMS = ("ids", "no ids")
# Common words, one or two tokens each; a random sequence of them defeats prefix caching.
_WORDS = tuple(
    "river stone quiet market lantern orbit velvet harbor copper meadow signal winter garden engine canvas "  # noqa: SIM905
    "thunder pocket mirror silver forest candle ladder rocket violet island breeze marble falcon tunnel "
    "saddle comet pepper lemon anchor feather glacier walnut".split()
)


def register(commands: Any) -> None:
    """Add the `bench` subcommand to the `pdclient` parser's subparsers."""
    bench = commands.add_parser(
        "bench",
        help="decode and client TTFT with and without forwarded ids, on your P/D pair",
        description="Interleaved A/B of the P/D handoff with and without forwarded prompt ids: decode time "
        "to first byte and client time to first token per prompt size, a table and a PNG plot.",
    )
    add_pair_arguments(bench)
    bench.add_argument(
        "--sizes", default="1000,4000", help="prompt sizes in tokens, comma-separated (default: 1000,4000)"
    )
    bench.add_argument("--pairs", type=int, default=30, help="A/B pairs per size (default: 30)")
    bench.add_argument("--max-tokens", type=int, default=4, help="tokens to decode per call (default: 4)")
    bench.add_argument("--plot", default="pdclient-bench.png", metavar="PNG", help="plot file ('' for none)")
    bench.add_argument("--json", metavar="PATH", help="also write every measurement to this JSON file")
    bench.add_argument("--seed", type=int, default=0, help="prompt generator seed (default: 0)")
    bench.set_defaults(func=run)


# -- measuring ---------------------------------------------------------------------------


@dataclass
class Sample:
    size: int
    arm: str
    tokens: int
    decode_ttft_ms: float
    client_ttft_ms: float
    prefill_ms: float | None
    fallback: str | None


@dataclass
class Prompts:
    """Distinct prompts of about ``size`` tokens: a unique tag, then random words."""

    rng: random.Random
    words_per_token: dict[int, float] = field(default_factory=dict)
    counter: int = 0

    def make(self, size: int) -> str:
        self.counter += 1
        ratio = self.words_per_token.get(size, 0.75)
        words = " ".join(self.rng.choice(_WORDS) for _ in range(max(1, int(size * ratio))))
        return f"[{self.counter}-{self.rng.getrandbits(32):08x}] Summarize this list in one word: {words}"

    def calibrate(self, size: int, tokens: int) -> None:
        ratio = self.words_per_token.get(size, 0.75)
        self.words_per_token[size] = ratio * size / max(tokens, 1)


def one_call(
    client: Any, traces: list[PDTrace], model: str, prompt: str, arm: str, size: int, max_tokens: int
) -> Sample:
    traces.clear()
    started = time.perf_counter()
    first_token_at: float | None = None
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"pdclient": {"forward_ids": arm == "ids"}},
    )
    with stream:
        for chunk in stream:
            if first_token_at is None and chunk.choices and chunk.choices[0].delta.content:
                first_token_at = time.perf_counter()
    trace = traces[-1] if traces else None
    if trace is None or trace.decode_first_byte_ms is None:
        raise CLIError("the decode leg returned no body; is the decode server healthy?")
    return Sample(
        size=size,
        arm=arm,
        tokens=trace.forwarded_tokens,
        decode_ttft_ms=trace.decode_first_byte_ms,
        client_ttft_ms=((first_token_at or time.perf_counter()) - started) * 1000,
        prefill_ms=trace.prefill_ms,
        fallback=trace.fallback,
    )


def measure(client: Any, traces: list[PDTrace], model: str, args: argparse.Namespace, sizes: list[int]) -> list[Sample]:
    prompts = Prompts(random.Random(args.seed))
    samples: list[Sample] = []
    for size in sizes:
        # Warm-up (not recorded): first-call costs, and the words-per-token ratio for this size.
        for _ in range(2):
            warm = one_call(client, traces, model, prompts.make(size), "ids", size, args.max_tokens)
            if warm.fallback is not None or warm.tokens == 0:
                raise CLIError(f"the handoff degraded ({warm.fallback}); run `pdclient doctor` on this pair")
            prompts.calibrate(size, warm.tokens)
        for pair in range(args.pairs):
            order = ARMS if pair % 2 == 0 else ARMS[::-1]
            for arm in order:
                samples.append(one_call(client, traces, model, prompts.make(size), arm, size, args.max_tokens))
            _progress(f"~{size} tokens: pair {pair + 1}/{args.pairs}")
        _progress("", done=True)
    return samples


def _progress(text: str, done: bool = False) -> None:
    if sys.stderr.isatty():
        sys.stderr.write("\r" + text.ljust(40) + ("\n" if done else ""))
    elif text and (done or text.endswith(("/10", "0"))):
        sys.stderr.write(text + "\n")
    sys.stderr.flush()


# -- reporting ---------------------------------------------------------------------------


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    position = (len(ordered) - 1) * q
    low, high = int(position), min(int(position) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def bootstrap_ci(differences: Sequence[float], rounds: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % bootstrap interval of the median paired difference."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(differences, k=len(differences))) for _ in range(rounds))
    return medians[int(0.025 * rounds)], medians[int(0.975 * rounds) - 1]


@dataclass
class Row:
    size: int
    tokens: int
    pairs: int
    decode: dict[str, tuple[float, float, float]]
    """arm -> (median, p10, p90) of decode TTFT ms."""
    client: dict[str, float]
    """arm -> median client TTFT ms."""
    saving: float
    saving_ci: tuple[float, float]


def summarize(samples: Sequence[Sample]) -> list[Row]:
    rows: list[Row] = []
    for size in sorted({s.size for s in samples}):
        arm = {a: [s for s in samples if s.size == size and s.arm == a] for a in ARMS}
        pairs = min(len(arm["ids"]), len(arm["no ids"]))
        decode = {
            a: (
                statistics.median(s.decode_ttft_ms for s in arm[a]),
                quantile([s.decode_ttft_ms for s in arm[a]], 0.1),
                quantile([s.decode_ttft_ms for s in arm[a]], 0.9),
            )
            for a in ARMS
        }
        diffs = [n.decode_ttft_ms - i.decode_ttft_ms for i, n in zip(arm["ids"], arm["no ids"], strict=False)]
        rows.append(
            Row(
                size=size,
                tokens=int(statistics.median(s.tokens for s in arm["ids"])),
                pairs=pairs,
                decode=decode,
                client={a: statistics.median(s.client_ttft_ms for s in arm[a]) for a in ARMS},
                saving=statistics.median(diffs),
                saving_ci=bootstrap_ci(diffs),
            )
        )
    return rows


def table(rows: Sequence[Row]) -> str:
    head = (
        f"{'tokens':>7} {'pairs':>5} | {'decode TTFT ms: ids':>20} {'no ids':>20} | "
        f"{'saving ms [95% CI]':>24} | {'client TTFT ms: ids':>19} {'no ids':>7}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:

        def cell(arm: str, r: Row = r) -> str:
            median, p10, p90 = r.decode[arm]
            return f"{median:7.1f} ({p10:5.0f}-{p90:5.0f})"

        ci = f"{r.saving:6.1f} [{r.saving_ci[0]:6.1f}, {r.saving_ci[1]:6.1f}]"
        lines.append(
            f"{r.tokens:>7} {r.pairs:>5} | {cell('ids'):>20} {cell('no ids'):>20} | {ci:>24} | "
            f"{r.client['ids']:>19.1f} {r.client['no ids']:>7.1f}"
        )
    lines.append("decode TTFT: median (p10-p90); saving: median of paired (no ids - ids) differences")
    return "\n".join(lines)


def plot(samples: Sequence[Sample], rows: Sequence[Row], path: str) -> str:
    import importlib

    try:
        importlib.import_module("matplotlib").use("Agg")  # files only, no display
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return "plot skipped: matplotlib is not installed (pip install matplotlib)"
    figure, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for axis, metric, title in (
        (axes[0], "decode_ttft_ms", "decode time to first byte"),
        (axes[1], "client_ttft_ms", "client time to first token"),
    ):
        for offset, (arm, color) in zip((-0.12, 0.12), ((ARMS[0], "tab:blue"), (ARMS[1], "tab:orange")), strict=True):
            for index, row in enumerate(rows):
                values = [getattr(s, metric) for s in samples if s.size == row.size and s.arm == arm]
                axis.scatter([index + offset] * len(values), values, s=9, alpha=0.45, color=color)
                axis.hlines(statistics.median(values), index + offset - 0.1, index + offset + 0.1, color=color, lw=2.5)
            axis.scatter([], [], color=color, label=f"{arm} (bar: median)")
        axis.set_xticks(range(len(rows)), [f"{r.tokens} tok" for r in rows])
        axis.set_ylabel("ms")
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
        axis.legend()
    figure.suptitle("P/D handoff with and without forwarded prompt ids (interleaved pairs)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot: {path}"


# -- the command ---------------------------------------------------------------------------


def _sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise CLIError(f"--sizes must be comma-separated integers, got {text!r}") from None
    if not sizes or min(sizes) < 16:
        raise CLIError(f"--sizes must list sizes of at least 16 tokens, got {text!r}")
    return sizes


def run(args: argparse.Namespace) -> int:
    sizes = _sizes(args.sizes)
    if args.pairs < 2:
        raise CLIError("--pairs must be at least 2")
    samples = _run_on_pair(args, sizes)
    rows = summarize(samples)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([s.__dict__ for s in samples], f, indent=1)
        print(f"measurements: {args.json}")
    if args.plot:
        print(plot(samples, rows, args.plot))
    return 0


def _run_on_pair(args: argparse.Namespace, sizes: list[int]) -> list[Sample]:
    traces: list[PDTrace] = []
    # Every call a handoff: what is compared with the decode server alone.
    client_args: dict[str, Any] = {
        "on_trace": traces.append,
        "max_retries": 0,
        "timeout": 600.0,
        "remote_prefill": "always",
    }
    with open_client(args, {"max_model_len": max(2048, max(sizes) + 512)}, **client_args) as (client, model):
        return measure(client, traces, model, args, sizes)
