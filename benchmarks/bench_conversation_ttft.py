"""A conversation's next turn: decode-only to the decode server that holds it, or a second P/D handoff.

    python benchmarks/bench_conversation_ttft.py                 # starts a LocalPD pair
    python benchmarks/bench_conversation_ttft.py --prefill URL --decode URL --sizes 30,300

Every sample is a conversation of its own (a unique tag first, so no other sample's cache
helps it). Turn 1 is a P/D call: a ~900-token prompt (system + user), a greedy answer of
up to 100 tokens streamed from the decode server. Turn 2 is turn 1's messages, the answer
as an assistant message and a user message of N new tokens, sent one of two ways:

- ``decode-only``  straight to the decode server that answered turn 1: its prefix cache
                   holds turn 1's prompt and answer, it computes only what is new;
- ``pd``           a second handoff: prefill leg on the prefill server (which holds turn 1's
                   prompt, not the answer), decode leg with its kv_transfer_params and ids.

Sizes and arms are interleaved, their order rotated every round. Per turn 2: client TTFT
(from the start of the call, prefill leg included, to the first token's chunk) and the
tokens each server computed (``usage.prompt_tokens - prompt_tokens_details.cached_tokens``;
the servers need ``--enable-prompt-tokens-details``, which a LocalPD started here gets).

``--stall-rounds K`` adds K rounds in which a long stream from another conversation runs
on the decode server while turn 2 is sent: the largest gap between that stream's chunks
during turn 2, against its median gap, is what the turn costs the decode server's other
streams (the reason P/D exists).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import statistics
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdclient.cli.bench import _WORDS, bootstrap_ci, quantile
from pdclient.wire import Kind, decode_body, plan_call, prefill_body, read_prefill

ARMS = ("decode-only", "pd")


@dataclass
class Sample:
    size: int
    round: int
    arm: str
    stall: bool
    turn1_prompt: int
    turn1_answer: int
    turn2_prompt: int
    new_tokens: int
    """Turn 2's prompt minus turn 1's prompt and answer: the new message and its template."""
    decode_computed: int
    """Tokens the decode server computed for turn 2 (prompt minus its cache hits)."""
    prefill_computed: int | None
    client_ttft_ms: float
    stall_max_gap_ms: float | None = None
    stall_median_gap_ms: float | None = None


@dataclass
class Stream:
    ttft: float | None = None
    text: str = ""
    usage: dict[str, Any] = field(default_factory=dict)


def stream_chat(
    http: httpx.Client, url: str, body: dict[str, Any], started: float, on_chunk: Callable[[], None] | None = None
) -> Stream:
    out = Stream()
    with http.stream("POST", f"{url}/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if on_chunk is not None:
                on_chunk()
            if chunk.get("usage"):
                out.usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                content = delta.get("content")
                # The first token: text, a tool call, or the end of turn (an answer may start with it).
                if out.ttft is None and (content or delta.get("tool_calls") or choice.get("finish_reason")):
                    out.ttft = time.perf_counter() - started
                out.text += content or ""
    return out


def computed(usage: dict[str, Any]) -> int:
    return int(usage["prompt_tokens"]) - int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


class Bench:
    def __init__(self, prefill: str, decode: str, model: str, seed: int) -> None:
        self.prefill, self.decode, self.model = prefill.rstrip("/"), decode.rstrip("/"), model
        self.http = httpx.Client(timeout=httpx.Timeout(300.0, connect=10.0))
        self.rng = random.Random(seed)
        self.words_per_token: dict[int, float] = {}

    def words(self, tokens: int, size_key: int) -> str:
        ratio = self.words_per_token.get(size_key, 0.75)
        return " ".join(self.rng.choice(_WORDS) for _ in range(max(1, int(tokens * ratio))))

    def calibrate(self, size_key: int, wanted: int, got: int) -> None:
        ratio = self.words_per_token.get(size_key, 0.75)
        self.words_per_token[size_key] = ratio * wanted / max(got, 1)

    def handoff(self, body: dict[str, Any], started: float) -> tuple[Stream, dict[str, Any]]:
        """One P/D call, as pdclient makes it: prefill leg, then a streamed decode leg with the ids."""
        plan = plan_call(Kind.CHAT, json.dumps(body).encode())
        prefill_response = self.http.post(
            f"{self.prefill}/chat/completions",
            content=prefill_body(plan),
            headers={"content-type": "application/json"},
        )
        prefill_response.raise_for_status()
        prefill = read_prefill(Kind.CHAT, prefill_response.content)
        decode = json.loads(decode_body(plan, prefill))
        return stream_chat(self.http, self.decode, decode, started), prefill_response.json()["usage"]

    def conversation(self, size: int, arm: str, round_: int, stall: bool) -> Sample:
        tag = uuid.uuid4().hex
        system = f"Conversation {tag}. Notes: " + self.words(850, -1)
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": system},
            {"role": "user", "content": "Tell me a short story about the notes above."},
        ]
        streamed = {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0}
        turn1, _ = self.handoff(
            {"model": self.model, "messages": messages, "max_tokens": 100, **streamed}, time.perf_counter()
        )
        self.calibrate(-1, 850, turn1.usage["prompt_tokens"] - 20)
        messages += [
            {"role": "assistant", "content": turn1.text},
            {"role": "user", "content": f"And now this: {self.words(size, size)}"},
        ]
        body = {"model": self.model, "messages": messages, "max_tokens": 4, **streamed}
        background = Background(self) if stall else None
        if background is not None:
            background.start()
        started = time.perf_counter()
        if arm == "decode-only":
            turn2, prefill_usage = stream_chat(self.http, self.decode, body, started), None
        else:
            turn2, prefill_usage = self.handoff(body, started)
        ended = time.perf_counter()
        gaps = background.stop(started, ended) if background is not None else (None, None)
        assert turn2.ttft is not None, "turn 2 streamed no content"
        new_tokens = turn2.usage["prompt_tokens"] - turn1.usage["prompt_tokens"] - turn1.usage["completion_tokens"]
        self.calibrate(size, size, new_tokens)
        return Sample(
            size=size,
            round=round_,
            arm=arm,
            stall=stall,
            turn1_prompt=turn1.usage["prompt_tokens"],
            turn1_answer=turn1.usage["completion_tokens"],
            turn2_prompt=turn2.usage["prompt_tokens"],
            new_tokens=new_tokens,
            # On the P/D path vLLM 0.32 reports the prefill's hits as the decode's cached
            # tokens (remote_prefill_cached_tokens): the decode's own work is not in usage.
            decode_computed=computed(turn2.usage) if prefill_usage is None else 0,
            prefill_computed=computed(prefill_usage) if prefill_usage is not None else None,
            client_ttft_ms=turn2.ttft * 1000,
            stall_max_gap_ms=gaps[0],
            stall_median_gap_ms=gaps[1],
        )


class Background:
    """A long stream of another conversation on the decode server; its chunk times show stalls."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.times: list[float] = []
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        body = {
            "model": self.bench.model,
            "messages": [{"role": "user", "content": f"[{uuid.uuid4().hex}] Count from one to five hundred."}],
            "max_tokens": 400,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }

        def tick() -> None:
            self.times.append(time.perf_counter())
            if len(self.times) >= 20:
                self.ready.set()

        with httpx.Client(timeout=300) as http:
            stream_chat(http, self.bench.decode, body, time.perf_counter(), on_chunk=tick)
        self.ready.set()

    def start(self) -> None:
        self.thread.start()
        self.ready.wait(120)

    def stop(self, started: float, ended: float) -> tuple[float | None, float | None]:
        self.thread.join(300)
        gaps_before = [b - a for a, b in itertools.pairwise(self.times) if b < started]
        during = [b - a for a, b in itertools.pairwise(self.times) if b > started and a < ended]
        if not during or not gaps_before:
            return None, None
        return max(during) * 1000, statistics.median(gaps_before) * 1000


def measure(
    bench: Bench,
    sizes: Sequence[int],
    rounds: int,
    stall_rounds: int,
    log: Callable[[str], None],
    save: Callable[[list[Sample]], None],
) -> list[Sample]:
    samples: list[Sample] = []
    for round_ in range(rounds + stall_rounds):
        stall = round_ >= rounds
        order = list(sizes[round_ % len(sizes) :]) + list(sizes[: round_ % len(sizes)])
        for size in order:
            arms = ARMS if (round_ + size) % 2 == 0 else ARMS[::-1]
            for arm in arms:
                sample = bench.conversation(size, arm, round_, stall)
                samples.append(sample)
                save(samples)
                log(
                    f"round {round_} size {size} {arm}{' (stall)' if stall else ''}: new {sample.new_tokens}, "
                    f"decode computed {sample.decode_computed}, prefill computed {sample.prefill_computed}, "
                    f"TTFT {sample.client_ttft_ms:.0f} ms"
                    + (f", stall {sample.stall_max_gap_ms:.0f} ms" if sample.stall_max_gap_ms is not None else "")
                )
    return samples


def report(samples: Sequence[Sample]) -> str:
    lines = [
        "| new tokens (median) | decode computed, decode-only | prefill computed, pd | TTFT decode-only ms (p10-p90) "
        "| TTFT pd ms (p10-p90) | pd - decode-only ms, median [95% CI] |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for size in sorted({s.size for s in samples}):
        rows = [s for s in samples if s.size == size and not s.stall]
        if not rows:
            continue
        by_arm = {arm: [s for s in rows if s.arm == arm] for arm in ARMS}
        pairs = [
            p.client_ttft_ms - d.client_ttft_ms
            for d in by_arm["decode-only"]
            for p in by_arm["pd"]
            if p.round == d.round
        ]

        def ttft(arm: str, by_arm: dict[str, list[Sample]] = by_arm) -> str:
            values = [s.client_ttft_ms for s in by_arm[arm]]
            return f"{statistics.median(values):.0f} ({quantile(values, 0.1):.0f}-{quantile(values, 0.9):.0f})"

        low, high = bootstrap_ci(pairs)
        lines.append(
            f"| {statistics.median(s.new_tokens for s in rows):.0f} "
            f"| {statistics.median(s.decode_computed for s in by_arm['decode-only']):.0f} "
            f"| {statistics.median(s.prefill_computed or 0 for s in by_arm['pd']):.0f} "
            f"| {ttft('decode-only')} | {ttft('pd')} | {statistics.median(pairs):+.0f} [{low:+.0f}, {high:+.0f}] |"
        )
    stalled = [s for s in samples if s.stall and s.stall_max_gap_ms is not None]
    if stalled:
        lines += [
            "",
            "With a concurrent stream on the decode server: its largest chunk gap during turn 2 (median over rounds)",
            "",
            "| new tokens (median) | stream's median gap ms | largest gap, decode-only ms | largest gap, pd ms "
            "| TTFT decode-only ms | TTFT pd ms |",
            "|---:|---:|---:|---:|---:|---:|",
        ]
        for size in sorted({s.size for s in stalled}):
            rows = [s for s in stalled if s.size == size]
            arm_rows = {arm: [s for s in rows if s.arm == arm] for arm in ARMS}
            if not all(arm_rows.values()):
                continue

            def med(values: list[float | None]) -> float:
                known = [v for v in values if v is not None]
                return statistics.median(known) if known else math.nan

            lines.append(
                f"| {statistics.median(s.new_tokens for s in rows):.0f} "
                f"| {med([s.stall_median_gap_ms for s in rows]):.0f} "
                f"| {med([s.stall_max_gap_ms for s in arm_rows['decode-only']]):.0f} "
                f"| {med([s.stall_max_gap_ms for s in arm_rows['pd']]):.0f} "
                f"| {med([s.client_ttft_ms for s in arm_rows['decode-only']]):.0f} "
                f"| {med([s.client_ttft_ms for s in arm_rows['pd']]):.0f} |"
            )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--prefill", metavar="URL", help="prefill base URL (default: start a LocalPD pair)")
    parser.add_argument("--decode", metavar="URL", help="decode base URL")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument(
        "--sizes", default="30,100,300,600,1000", help="new tokens in turn 2 (default: 30,100,300,600,1000)"
    )
    parser.add_argument("--rounds", type=int, default=8, help="interleaved rounds, one conversation per size and arm")
    parser.add_argument("--stall-rounds", type=int, default=0, help="extra rounds with a concurrent decode stream")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="directory for the JSON samples")
    parser.add_argument("--from-json", type=Path, metavar="PATH", help="only report on the samples of an earlier run")
    parser.add_argument(
        "--exclude",
        default="",
        metavar="ROUND:SIZE,...",
        help="leave these (round, size) pairs, both arms, out of the report (e.g. disturbed by other work)",
    )
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]

    def log(text: str) -> None:
        print(time.strftime("%H:%M:%S"), text, file=sys.stderr, flush=True)

    path = args.out / "conversation_ttft.json"

    def save(samples: list[Sample]) -> None:
        # After every sample: a long run stopped half-way still leaves what it measured.
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"samples": [asdict(s) for s in samples]}))

    def run(prefill: str, decode: str) -> list[Sample]:
        return measure(Bench(prefill, decode, args.model, args.seed), sizes, args.rounds, args.stall_rounds, log, save)

    if args.from_json:
        samples = [Sample(**s) for s in json.loads(args.from_json.read_text())["samples"]]
    elif args.prefill and args.decode:
        samples = run(args.prefill, args.decode)
    else:
        from pdclient.local import LocalPD

        with LocalPD(max_model_len=8192, extra_server_args=("--enable-prompt-tokens-details",)) as pd:
            samples = run(pd.prefill_url, pd.decode_url)
    excluded = {tuple(int(x) for x in item.split(":")) for item in args.exclude.split(",") if item}
    print(report([s for s in samples if (s.round, s.size) not in excluded]))
    if not args.from_json:
        save(samples)
        print(f"samples: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
