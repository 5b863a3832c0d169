"""Multi-turn conversations through PDChatClient: ``remote_prefill`` ``"auto"`` against ``"always"`` and ``"never"``.

    python benchmarks/bench_conversations.py --rounds 6                # starts a LocalPD pair
    PDCLIENT_PREFILL_BASE_URL=... PDCLIENT_DECODE_BASE_URL=... python benchmarks/bench_conversations.py
    python benchmarks/bench_conversations.py --from-json benchmarks/results/conversations.json

The servers: ``pdclient.local.pair_from_env_or_local`` (a LocalPD started with
``--enable-prompt-tokens-details``, so that ``usage`` says what each server found cached;
servers from the environment need that flag for the "computed" column).

Two conversation shapes, each conversation with its own unique prefix (a fresh tag first:
no arm or round is helped by another's cache):

- ``chat``: a ~900-token system message and a first user question, then follow-ups of
  30, 150 and 300 new tokens, then a LONG follow-up of 1500 new tokens (a pasted document;
  sizes are nominal, the words per token learned as it goes: the 2026-12-01 run measured
  first turns of 690-960 tokens and follow-ups of ~40, ~160, ~310 and ~1500);
- ``tool``: a ~600-token system message (an agent's instructions) and a task, then four
  short tool results (20-60 tokens) appended as user messages, one per step (SmolLM2's
  chat template has no tool role; the wire shape is the same: a short new message after
  the previous answer).

Every turn sends the whole history (the previous answers as assistant messages), streamed
with ``stream_options.include_usage``, greedy, ``max_tokens`` 32 (``--max-tokens``: the
answers' length, which the prefill server recomputes on every P/D follow-up). The arms, ``always``,
``never`` and ``auto`` (one PDChatClient each, ``remote_prefill=`` in the constructor;
``--arms`` for fewer), run a conversation of the same shape side by side: turn k of each
arm in turn, the order rotated per round and shape. Per turn: client TTFT
(``create()`` to the first content chunk), the whole turn (to the end of the stream), the
trace's outcome, ``remote_prefill`` decision, reason and ``estimated_uncached_tokens``, and
the tokens the server computed (``usage.prompt_tokens - prompt_tokens_details.cached_tokens``;
on a P/D call vLLM 0.32's decode reports the prefill's hits, so this is the prefill's work).

Printed per turn type: medians per arm, and the paired ratios auto/always, auto/never and
auto/(the better of the two) (the median of the per-group ratios, same round, shape and
turn) with a bootstrap 95 % interval; then per arm, where the prompt tokens were computed
(a P/D turn's on the prefill server, a decode-only turn's on the decode server, and
what auto's prefill warm-ups computed on the prefill server, from their ``usage``) and the
largest computation one turn put on the decode server; then per arm, of its follow-ups
the short ones (those auto's rule sends decode-only on the true counts: what a decode-only
run computes, the server's count when it ran so, else from the turn before's counts), how
many went decode-only, and the estimate's error on them. After an auto turn with a warm-up,
the next turn (of any arm) waits until the warm-up has ended: the prefill server serves
every arm, and in use the next message of a conversation comes later than its answer.
Results: ``benchmarks/results/conversations.{json,png}`` (``--out``), the JSON rewritten
after every turn so a run stopped half-way keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

from pdclient import ConversationSettings, PDTrace
from pdclient.cli.bench import bootstrap_ci
from pdclient.local import PDServers, pair_from_env_or_local

ARMS = ("always", "never", "auto", "replicas2", "serve2")
"""``replicas2``: ``auto`` through two PDChatClients that share nothing, the turns alternating
between them (two replicas behind a round-robin balancer); ``serve2``: ``auto`` through
``pdclient serve --workers 2``, each turn on a new connection (so either worker takes it)."""
DEFAULT_ARMS = ("always", "never", "auto")
MODE = {"replicas2": "auto", "serve2": "auto"}
MAX_TOKENS = 32
"""Each answer's ``max_tokens`` unless ``--max-tokens`` says otherwise."""
# Common words, one or two tokens each; a random sequence of them defeats prefix caching.
WORDS = tuple(
    "river stone quiet market lantern orbit velvet harbor copper meadow signal winter garden engine canvas "  # noqa: SIM905
    "thunder pocket mirror silver forest candle ladder rocket violet island breeze marble falcon tunnel "
    "saddle comet pepper lemon anchor feather glacier walnut".split()
)
# (turn type, new tokens) after the first turn; the first turn's size is its system message.
SHAPES: dict[str, tuple[int, list[tuple[str, int]]]] = {
    "chat": (900, [("follow-up 30", 30), ("follow-up 150", 150), ("follow-up 300", 300), ("long 1500", 1500)]),
    "tool": (600, [("tool result", 20), ("tool result", 60), ("tool result", 30), ("tool result", 45)]),
}
TYPES = ("first", "follow-up 30", "follow-up 150", "follow-up 300", "tool result", "long 1500")


@dataclass
class Turn:
    round: int
    shape: str
    arm: str
    index: int
    type: str
    first_arm: bool
    """This arm went first in this round and shape."""
    prompt_tokens: int
    new_tokens: int
    """This turn's prompt minus the previous turn's prompt and answer (0 for a first turn)."""
    completion_tokens: int
    computed_tokens: int | None
    """prompt_tokens - cached_tokens as usage reports them; None without prompt_tokens_details."""
    ttft_ms: float
    latency_ms: float
    outcome: str
    remote_prefill: bool | None
    reason: str | None
    conversation: str | None
    estimated_uncached_tokens: int | None
    decode_url: str | None
    started_at: float
    warm_up_computed_tokens: int = 0
    """What this turn's prefill warm-up (auto, decode-only) computed on the prefill server."""
    warm_up_wait_ms: float = 0.0
    """How long after the turn its warm-up took to end (the next turn waited for it)."""


def log(text: str) -> None:
    print(time.strftime("%H:%M:%S"), text, file=sys.stderr, flush=True)


class Conversation:
    """One arm's conversation: its history, and the client and traces of its arm."""

    def __init__(
        self,
        clients: Sequence[Any],
        traces: list[PDTrace],
        model: str,
        system: str,
        user: str,
        max_tokens: int,
    ) -> None:
        self.clients, self.traces, self.model, self.max_tokens = clients, traces, model, max_tokens
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": user}]
        self.previous: tuple[int, int] | None = None
        self.turns = 0

    @property
    def client(self) -> Any:
        """This turn's client: the arm's one, or its replicas' in turn."""
        return self.clients[self.turns % len(self.clients)]

    def turn(self) -> tuple[float, float, str, dict[str, Any], PDTrace]:
        self.traces.clear()
        client = self.client
        self.turns += 1
        started = time.perf_counter()
        if isinstance(client, ServeArm):
            stream = client.create(self.traces, self.model, self.messages, self.max_tokens)
        else:
            stream = client.chat.completions.create(
                model=self.model,
                messages=self.messages,  # type: ignore[arg-type]
                stream=True,
                stream_options={"include_usage": True},
                temperature=0,
                max_tokens=self.max_tokens,
            )
        ttft: float | None = None
        text, usage = "", {}
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage.model_dump()
            for choice in chunk.choices:
                if ttft is None and (choice.delta.content or choice.finish_reason):
                    ttft = time.perf_counter() - started
                text += choice.delta.content or ""
        latency = time.perf_counter() - started
        assert ttft is not None and usage, "the turn streamed no content or no usage"
        assert len(self.traces) == 1, self.traces
        self.messages.append({"role": "assistant", "content": text})
        return ttft * 1000, latency * 1000, text, usage, self.traces[0]


class ServeArm:
    """``pdclient serve --workers 2`` on the pair; each call on a new connection, its trace from its headers."""

    def __init__(self, pd: PDServers, workers: int = 2) -> None:
        command = [sys.executable, "-m", "pdclient", "serve", "--port", str(_free_port()), "--workers", str(workers)]
        command += ["--prefill", *pd.prefill_urls, "--decode", *pd.decode_urls, "--trace-headers"]
        self.url = f"http://127.0.0.1:{command[command.index('--port') + 1]}/v1"
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url.removesuffix("/v1") + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError("pdclient serve did not start")

    def create(self, traces: list[PDTrace], model: str, messages: list[dict[str, Any]], max_tokens: int) -> Any:
        http = httpx.Client(timeout=600.0)  # a new connection: the kernel deals it to either worker
        client = openai.OpenAI(base_url=self.url, api_key="-", max_retries=0, http_client=http)
        raw = client.chat.completions.with_raw_response.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            stream=True,
            stream_options={"include_usage": True},
            temperature=0,
            max_tokens=max_tokens,
        )
        traces.append(PDTrace.from_headers(raw.headers))
        return raw.parse()

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Bench:
    def __init__(
        self, pd: PDServers, seed: int, arms: Sequence[str] = DEFAULT_ARMS, max_tokens: int = MAX_TOKENS
    ) -> None:
        self.pd = pd
        self.arms = tuple(arms)
        self.max_tokens = max_tokens
        self.rng = random.Random(seed)
        self.tokens_per_word = 1.4
        self.traces: dict[str, list[PDTrace]] = {arm: [] for arm in self.arms}
        self.clients: dict[str, list[Any]] = {}
        for arm in self.arms:
            if arm == "serve2":
                self.clients[arm] = [ServeArm(pd)]
                continue
            replicas = 2 if arm == "replicas2" else 1
            self.clients[arm] = [
                pd.client(
                    remote_prefill=MODE.get(arm, arm), on_trace=self.traces[arm].append, max_retries=0, timeout=600.0
                )
                for _ in range(replicas)
            ]

    def close(self) -> None:
        for clients in self.clients.values():
            for client in clients:
                client.close()

    def words(self, tokens: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(max(1, round(tokens / self.tokens_per_word))))

    def round(self, round_: int, shape: str, save: Callable[[Turn], None]) -> None:
        system_tokens, follow_ups = SHAPES[shape]
        shift = (round_ + list(SHAPES).index(shape)) % len(self.arms)
        arms = self.arms[shift:] + self.arms[:shift]
        # The same words for every arm, each conversation behind its own tag.
        if shape == "chat":
            body, user = self.words(system_tokens), "Summarize the notes above in one sentence."
        else:
            body, user = self.words(system_tokens), "Task: find the anchor in the notes. Call tools step by step."
        texts = [self.words(n) for _, n in follow_ups]
        conversations = {
            arm: Conversation(
                self.clients[arm],
                self.traces[arm],
                self.pd.model,
                f"Conversation {uuid.uuid4().hex}. Notes: {body}",
                user,
                self.max_tokens,
            )
            for arm in self.arms
        }
        steps = [("first", 0, "")] + [(kind, n, text) for (kind, n), text in zip(follow_ups, texts, strict=True)]
        for index, (kind, wanted, text) in enumerate(steps):
            for arm in arms:
                c = conversations[arm]
                if index:
                    prefix = "Tool result: " if shape == "tool" else "And this: "
                    c.messages.append({"role": "user", "content": prefix + text})
                at = time.time()
                # A serve arm's warm-ups happen in its workers, out of sight (counted as 0 here).
                warmer = getattr(getattr(c.client, "pd_fleet", None), "warmer", None)
                warmed_before = warmer.prompt_tokens - warmer.cached_tokens if warmer is not None else 0
                ttft, latency, _, usage, trace = c.turn()
                # The next turn, of any arm, waits for this one's warm-up: the prefill server is
                # the other arms' too, and a user's or a tool's next message takes its time.
                wait_started = time.perf_counter()
                deadline = wait_started + 300
                while warmer is not None and warmer.pending and time.perf_counter() < deadline:
                    time.sleep(0.005)
                warm_up_wait_ms = (time.perf_counter() - wait_started) * 1000
                warmed = warmer.prompt_tokens - warmer.cached_tokens - warmed_before if warmer is not None else 0
                prompt = int(usage["prompt_tokens"])
                new = 0 if c.previous is None else prompt - c.previous[0] - c.previous[1]
                c.previous = (prompt, int(usage["completion_tokens"]))
                details = usage.get("prompt_tokens_details")
                computed = prompt - int(details.get("cached_tokens") or 0) if details else None
                if index and new > 0 and wanted >= 100:
                    # Keep the new parts near their nominal size: learn words per token.
                    self.tokens_per_word = min(2.5, max(1.0, self.tokens_per_word * new / (wanted + 12)))
                turn = Turn(
                    round=round_,
                    shape=shape,
                    arm=arm,
                    index=index,
                    type=kind,
                    first_arm=arm == arms[0],
                    prompt_tokens=prompt,
                    new_tokens=new,
                    completion_tokens=int(usage["completion_tokens"]),
                    computed_tokens=computed,
                    ttft_ms=ttft,
                    latency_ms=latency,
                    outcome=str(trace.outcome.value),
                    remote_prefill=trace.remote_prefill,
                    reason=trace.remote_prefill_reason,
                    conversation=trace.conversation,
                    estimated_uncached_tokens=trace.estimated_uncached_tokens,
                    decode_url=trace.decode_url,
                    started_at=at,
                    warm_up_computed_tokens=warmed,
                    warm_up_wait_ms=warm_up_wait_ms,
                )
                save(turn)
                log(
                    f"round {round_} {shape} turn {index} ({kind}) {arm}: prompt {prompt}, new {new}, "
                    f"computed {computed}, {turn.outcome} ({turn.reason}, est. uncached "
                    f"{turn.estimated_uncached_tokens}), TTFT {ttft:.0f} ms, turn {latency:.0f} ms"
                    + (
                        f", warm-up computed {warmed} in {warm_up_wait_ms:.0f} ms more"
                        if trace.prefill_warm_up_url
                        else ""
                    )
                )


# -- the report ----------------------------------------------------------------------------


def groups(turns: Sequence[Turn], kind: str) -> list[dict[str, Turn]]:
    """Per round, shape and position of this kind: each arm's turn there (every arm present)."""
    arms = arms_in(turns)
    by_key: dict[tuple[int, str, int], dict[str, Turn]] = {}
    for t in turns:
        if t.type == kind:
            by_key.setdefault((t.round, t.shape, t.index), {})[t.arm] = t
    return [v for _, v in sorted(by_key.items()) if len(v) == len(arms)]


def arms_in(turns: Sequence[Turn]) -> list[str]:
    """The arms a run had, in ``ARMS`` order (an earlier run may have had two)."""
    present = {t.arm for t in turns}
    return [arm for arm in ARMS if arm in present]


def ratios(group: Sequence[dict[str, Turn]], against: str) -> list[float]:
    """auto's TTFT over ``against``'s, per group; ``best``: over the better of always and never."""
    if against == "best":
        return [g["auto"].ttft_ms / min(g["always"].ttft_ms, g["never"].ttft_ms) for g in group]
    return [g["auto"].ttft_ms / g[against].ttft_ms for g in group]


def baselines(arms: Sequence[str]) -> list[str]:
    """What auto is compared with in this run."""
    if "auto" not in arms:
        return []
    others = [arm for arm in arms if arm != "auto"]
    return others + (["best"] if {"always", "never"} <= set(arms) else [])


def ratio_ci(values: Sequence[float]) -> str:
    if not values:
        return "-"
    low, high = bootstrap_ci(values) if len(values) > 1 else (values[0], values[0])
    return f"{statistics.median(values):.2f} [{low:.2f}, {high:.2f}]"


def med(values: Sequence[float | int | None]) -> str:
    known = [v for v in values if v is not None]
    return f"{statistics.median(known):.0f}" if known else "-"


def on_decode(turn: Turn) -> bool:
    """Whether the decode server computed this turn's prompt (no prefill leg answered it)."""
    return turn.outcome in ("decode_only", "prefill_failed")


SETTINGS = ConversationSettings()
"""The thresholds auto decides with (the clients' and serve's defaults)."""
BLOCK = 128
"""The CPU servers' KV block size."""


def decode_uncached(turn: Turn, previous: Turn) -> int:
    """What a decode-only run of ``turn`` computes on its decode endpoint: the server's count
    when it ran so, else from the servers' counts of the turn before: a decode-only turn
    leaves its prompt and its answer but the last id cached, in whole blocks; a P/D turn its
    prompt's whole blocks (vLLM 0.32's decode mostly misses the block with the answer's start)."""
    if on_decode(turn) and turn.computed_tokens is not None:
        return turn.computed_tokens
    held = previous.prompt_tokens + (previous.completion_tokens - 1 if on_decode(previous) else 0)
    return turn.prompt_tokens - min(held // BLOCK * BLOCK, turn.prompt_tokens - 1)


def should_skip_prefill(turn: Turn, previous: Turn) -> bool:
    """Whether auto's rule, given the true counts, sends ``turn`` decode-only."""
    uncached = decode_uncached(turn, previous)
    return uncached < SETTINGS.threshold_tokens and uncached / turn.prompt_tokens < SETTINGS.max_uncached_ratio


def follow_ups(turns: Sequence[Turn], arm: str) -> list[tuple[Turn, Turn]]:
    """The arm's follow-ups, each with the turn before it, on the same decode endpoint."""
    by_key = {(t.round, t.shape, t.index): t for t in turns if t.arm == arm}
    pairs = []
    for (round_, shape, index), turn in sorted(by_key.items()):
        previous = by_key.get((round_, shape, index - 1))
        if index and previous is not None and turn.decode_url == previous.decode_url:
            pairs.append((turn, previous))
    return pairs


def decided(turns: Sequence[Turn]) -> str:
    """Per arm: of the follow-ups auto's rule sends decode-only on the true counts (the short
    ones), how many went so, and how far the estimate was from the true count."""
    lines = [
        "| arm | follow-ups | short (decode-only by the true counts) | short ones decode-only "
        "| others decode-only | est. uncached - true, short ones: median [min, max] |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for arm in arms_in(turns):
        pairs = follow_ups(turns, arm)
        short = [(t, p) for t, p in pairs if should_skip_prefill(t, p)]
        errors = [(t.estimated_uncached_tokens or 0) - decode_uncached(t, p) for t, p in short]
        others = sum(1 for t, p in pairs if not should_skip_prefill(t, p) and t.outcome == "decode_only")
        spread = f"{statistics.median(errors):+.0f} [{min(errors):+d}, {max(errors):+d}]" if errors else "-"
        lines.append(
            f"| {arm} | {len(pairs)} | {len(short)} | {sum(t.outcome == 'decode_only' for t, _ in short)} "
            f"| {others} | {spread} |"
        )
    return "\n".join(lines)


def report(turns: Sequence[Turn]) -> str:
    arms = arms_in(turns)
    versus = baselines(arms)
    names = {"best": "the better of always and never"}
    lines = [
        "| turn | groups | new tokens | auto: decode-only / P/D | auto est. uncached "
        f"| computed {' / '.join(arms)} | "
        + " | ".join(f"TTFT ms {arm}" for arm in arms)
        + "".join(f" | TTFT auto / {names.get(v, v)} [95% CI]" for v in versus)
        + " |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * (len(arms) + len(versus)),
    ]
    for kind in TYPES:
        group = groups(turns, kind)
        if not group:
            continue
        auto = [g["auto"] for g in group] if "auto" in arms else []
        decode_only = sum(1 for t in auto if t.outcome == "decode_only")
        lines.append(
            f"| {kind} | {len(group)} | {med([g[arms[0]].new_tokens for g in group])} "
            f"| {f'{decode_only} / {len(auto) - decode_only}' if auto else '-'} "
            f"| {med([t.estimated_uncached_tokens for t in auto])} "
            f"| {' / '.join(med([g[arm].computed_tokens for g in group]) for arm in arms)} | "
            + " | ".join(med([g[arm].ttft_ms for g in group]) for arm in arms)
            + "".join(f" | {ratio_ci(ratios(group, v))}" for v in versus)
            + " |"
        )
    lines += [
        "",
        "| arm | prompt tokens computed on the prefill server | of which warm-ups | on the decode server "
        "| decode server's share | largest on the decode server in one turn (its type) |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for arm in arms:
        mine = [t for t in turns if t.arm == arm and t.computed_tokens is not None]
        decode = [t for t in mine if on_decode(t)]
        on_d = sum(t.computed_tokens or 0 for t in decode)
        warm_ups = sum(t.warm_up_computed_tokens for t in mine)
        on_p = sum(t.computed_tokens or 0 for t in mine if not on_decode(t)) + warm_ups
        largest = max(decode, key=lambda t: t.computed_tokens or 0, default=None)
        share = f"{100 * on_d / (on_d + on_p):.0f} %" if on_d + on_p else "-"
        top = f"{largest.computed_tokens} ({largest.type})" if largest else "-"
        lines.append(f"| {arm} | {on_p} | {warm_ups} | {on_d} | {share} | {top} |")
    return "\n".join(lines)


COLOURS = {
    "always": "tab:blue",
    "never": "tab:green",
    "auto": "tab:orange",
    "replicas2": "tab:purple",
    "serve2": "tab:brown",
    "best": "tab:gray",
}


def plot(turns: Sequence[Turn], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter

    arms = arms_in(turns)
    versus = baselines(arms)
    kinds = [k for k in TYPES if groups(turns, k)]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    rng = random.Random(0)
    width = 0.8 / len(arms)
    for i, kind in enumerate(kinds):
        group = groups(turns, kind)
        for j, arm in enumerate(arms):
            values = [g[arm].ttft_ms / 1000 for g in group]
            x = i + (j - (len(arms) - 1) / 2) * width
            colour = COLOURS[arm]
            left.scatter([x + rng.uniform(-0.04, 0.04) for _ in values], values, s=9, color=colour, alpha=0.6)
            left.hlines(statistics.median(values), x - width / 3, x + width / 3, color=colour, lw=2)
        for j, against in enumerate(versus):
            values = ratios(group, against)
            x = i + (j - (len(versus) - 1) / 2) * (0.8 / max(len(versus), 1))
            low, high = bootstrap_ci(values) if len(values) > 1 else (values[0], values[0])
            mid = statistics.median(values)
            colour = COLOURS[against]
            right.scatter([x + rng.uniform(-0.03, 0.03) for _ in values], values, s=8, color=colour, alpha=0.4)
            right.errorbar([x], [mid], yerr=[[mid - low], [high - mid]], fmt="o", color=colour, capsize=3)
    for arm in arms:
        left.plot([], [], color=COLOURS[arm], lw=2, label=arm)
    for against in versus:
        label = "auto / better of always, never" if against == "best" else f"auto / {against}"
        right.plot([], [], "o", color=COLOURS[against], label=label)
    for ax in (left, right):
        ax.set_xticks(range(len(kinds)), kinds, rotation=20)
        ax.set_yscale("log")
        ax.legend(fontsize=8)
    left.set_ylabel("client TTFT, s (log)")
    left.set_title("TTFT per turn, medians as bars")
    right.axhline(1.0, color="tab:red", lw=1, ls="--")
    right.yaxis.set_major_formatter(FormatStrFormatter("%.1f"))
    right.yaxis.set_minor_formatter(FormatStrFormatter("%.1f"))
    right.set_ylabel("TTFT ratio, same round and turn (log)")
    right.set_title("paired ratios: median and bootstrap 95% CI")
    rounds = len({t.round for t in turns})
    fig.suptitle(f"remote_prefill {' / '.join(arms)}, LocalPD pair (SmolLM2-135M, vLLM CPU, NIXL), {rounds} rounds")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=6, help="rounds; each runs every shape with every arm")
    parser.add_argument(
        "--arms",
        default=",".join(DEFAULT_ARMS),
        help=f"arms, of {','.join(ARMS)} (default: {','.join(DEFAULT_ARMS)}; replicas2 and serve2 are auto "
        "through two clients alternating and through pdclient serve --workers 2)",
    )
    parser.add_argument("--shapes", default="chat,tool", help="conversation shapes (default: chat,tool)")
    parser.add_argument("--max-tokens", type=int, default=MAX_TOKENS, help=f"each answer's max_tokens ({MAX_TOKENS})")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"), help="directory for JSON and PNG")
    parser.add_argument("--from-json", type=Path, metavar="PATH", help="only report on an earlier run's turns")
    args = parser.parse_args()
    arms = args.arms.split(",")
    unknown = set(arms) - set(ARMS)
    if unknown:
        parser.error(f"--arms: unknown {', '.join(sorted(unknown))}; choose from {', '.join(ARMS)}")
    json_path = args.out / "conversations.json"
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        turns = [Turn(**t) for t in data["turns"]]
    else:
        turns = []
        meta: dict[str, Any] = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "args": vars(args) | {"out": str(args.out)},
        }

        def save(turn: Turn) -> None:
            turns.append(turn)
            args.out.mkdir(parents=True, exist_ok=True)
            load = [round(time.time()), *Path("/proc/loadavg").read_text().split()[:3]]
            meta["loadavg"] = [*meta.get("loadavg", []), load]
            json_path.write_text(json.dumps({**meta, "turns": [asdict(t) for t in turns]}, indent=0))

        log("starting or finding the pair")
        with pair_from_env_or_local(max_model_len=8192, extra_server_args=("--enable-prompt-tokens-details",)) as pd:
            bench = Bench(pd, args.seed, arms, args.max_tokens)
            try:
                for round_ in range(args.rounds):
                    for shape in args.shapes.split(","):
                        bench.round(round_, shape, save)
            finally:
                bench.close()
    print(report(turns))
    print()
    print(decided(turns))
    print(f"rounds: {len({t.round for t in turns})}, turns: {len(turns)}")
    if turns:
        out = args.from_json.parent if args.from_json else args.out
        plot(turns, out / "conversations.png")
        print(f"results: {json_path if not args.from_json else args.from_json}, {out / 'conversations.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
