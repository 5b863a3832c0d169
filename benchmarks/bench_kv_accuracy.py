"""How exact ``remote_prefill="auto"``'s cached counts are, against the decode server's own.

    python benchmarks/bench_kv_accuracy.py                          # starts a LocalPD pair
    python benchmarks/bench_kv_accuracy.py --conversations 8 --turns 4 --blocks 64

A LocalPD pair with KV events on and a small KV cache (``--num-gpu-blocks-override``:
``--blocks`` blocks of 128 tokens a server), and more conversations than fit in it, each
with its own unique prefix. Two arms run side by side over conversations of the same
shape, turn k of every conversation of each arm before turn k+1 of any, so the cache
pressure is shared and evicts conversations between their turns:

- ``events``: a PDChatClient with ``kv_events="discover"`` (the decode's own KV events
  decide where they know, ``PDTrace.cache_source``);
- ``estimate``: a PDChatClient without them (today's estimator).

Each decode-only decision's predicted cached tokens (``PDTrace.cached_tokens``) is compared
with what the decode server reports it found cached (``usage.prompt_tokens_details
.cached_tokens``; LocalPD runs with ``--enable-prompt-tokens-details``). Beside each call
of the ``events`` arm, the estimator's own figure for the same call on the same memory
(``ConversationMemory.estimate`` without the events) and its decision.

Printed: per arm, the decode-only decisions, the share within one block of the truth, the
share exact, how many over-counted (the decode then prefilled more than planned: the
costly error) and by how much at most; for the ``events`` arm, the calls its events handed
off where the estimator beside would have sent them decode-only (evicted conversations),
and the decisions the events did not know (``cache_source`` ``"estimate"``). ``--out``: the
per-call records as JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdclient import Outcome, PDChatClient, PDTrace
from pdclient.conversations import decide_remote_prefill
from pdclient.local import LocalPD
from pdclient.wire import Kind, affinity_key

BLOCK = 128
"""vLLM's CPU block size (the conversations' default ``block_size``)."""

_WORDS = [
    "robot",
    "garden",
    "lantern",
    "river",
    "morning",
    "paint",
    "quiet",
    "market",
    "bridge",
    "signal",
    "harbor",
    "letter",
    "violet",
    "engine",
    "orchard",
    "copper",
    "window",
    "meadow",
    "thunder",
    "pocket",
    "ladder",
    "mirror",
    "candle",
    "silver",
    "forest",
]


@dataclass
class Call:
    arm: str
    conversation: int
    turn: int
    outcome: str
    cache_source: str | None
    predicted: int | None
    """``PDTrace.cached_tokens``: the cached count the decision used."""
    truth: int | None
    """The decode server's ``cached_tokens`` (a decode-only call's; a P/D call's is the prefill's)."""
    prompt_tokens: int | None
    estimator: int | None = None
    """The estimator's cached count for the same call, on the same memory (the events arm)."""
    estimator_decode_only: bool | None = None


def system_prompt(rng: random.Random, words: int) -> str:
    sentences = []
    while sum(len(s.split()) for s in sentences) < words:
        sentences.append(" ".join(rng.choice(_WORDS) for _ in range(rng.randint(6, 14))).capitalize() + ".")
    return f"Conversation {uuid.uuid4().hex}. Notes: " + " ".join(sentences)


def questions(rng: random.Random, turns: int) -> list[str]:
    asks = ["Tell me a short story about the notes.", "Give it a title.", "What happens next?", "And a moral?"]
    asks += [f"Now add a {rng.choice(_WORDS)} to it." for _ in range(max(0, turns - len(asks)))]
    return asks[:turns]


def beside(client: PDChatClient, model: str, messages: list[dict[str, Any]]) -> tuple[int, bool]:
    """The estimator's cached count and whether it would go decode-only, for this call on the client's memory."""
    fleet = client.pd_fleet
    body = {"model": model, "messages": messages}
    key = affinity_key(Kind.CHAT, messages, None, None)
    estimate = fleet.memory.estimate(key, body, [e.url for e in fleet.decode.admitted()])
    decision = decide_remote_prefill("auto", estimate, client.pd_options.conversations)
    return estimate.cached_tokens, not decision.remote_prefill


def run(pd: LocalPD, args: argparse.Namespace) -> list[Call]:
    traces: dict[str, list[PDTrace]] = {"events": [], "estimate": []}
    clients = {
        arm: PDChatClient(
            prefill_base_url=pd.prefill_urls,
            decode_base_url=pd.decode_urls,
            api_key="EMPTY",
            remote_prefill="auto",
            kv_events="discover" if arm == "events" else None,
            on_trace=traces[arm].append,
        )
        for arm in traces
    }
    events = clients["events"]
    events.pd_fleet.start()
    feeds = events.pd_fleet.kv_events
    assert feeds is not None
    deadline = time.monotonic() + 60
    while not all((index := feeds.index(url)) is not None and index.synced for url in pd.decode_urls):
        if time.monotonic() > deadline:
            raise SystemExit("the decode servers' KV events never synced")
        time.sleep(0.1)
    rng = random.Random(args.seed)
    asks = [questions(rng, args.turns) for _ in range(args.conversations)]
    # The same words in each arm's conversation c, after a tag of its own: no arm's cache helps the other's.
    histories = {
        (arm, c): [{"role": "system", "content": system_prompt(random.Random(args.seed + c), args.system_words)}]
        for arm in clients
        for c in range(args.conversations)
    }
    calls: list[Call] = []
    try:
        for turn in range(args.turns):
            # A fresh order each turn: in a fixed round a cache smaller than all the
            # conversations evicts every one before its next turn (LRU), here only some.
            order = [(c, arm) for c in range(args.conversations) for arm in clients]
            rng.shuffle(order)
            for c, arm in order:
                client = clients[arm]
                messages = [*histories[(arm, c)], {"role": "user", "content": asks[c][turn]}]
                estimator = beside(client, pd.model, messages) if arm == "events" else None
                answer = client.chat.completions.create(
                    model=pd.model,
                    messages=messages,  # type: ignore[arg-type]
                    temperature=0,
                    max_tokens=args.max_tokens,
                )
                trace = traces[arm][-1]
                usage = answer.usage
                details = usage.prompt_tokens_details if usage is not None else None
                call = Call(
                    arm=arm,
                    conversation=c,
                    turn=turn,
                    outcome=trace.outcome.value if trace.outcome is not None else "",
                    cache_source=trace.cache_source,
                    predicted=trace.cached_tokens,
                    truth=details.cached_tokens if details is not None else None,
                    prompt_tokens=usage.prompt_tokens if usage is not None else None,
                    estimator=estimator[0] if estimator else None,
                    estimator_decode_only=estimator[1] if estimator else None,
                )
                calls.append(call)
                print(
                    f"turn {turn} conv {c:2d} {arm:8s} {call.outcome:14s} source={call.cache_source} "
                    f"predicted={call.predicted} truth={call.truth} prompt={call.prompt_tokens}"
                    + (f" estimator={call.estimator}" if estimator else ""),
                    file=sys.stderr,
                )
                histories[(arm, c)] = [
                    *messages,
                    {"role": "assistant", "content": answer.choices[0].message.content or ""},
                ]
    finally:
        for client in clients.values():
            client.close()
    return calls


def within(predicted: int, truth: int) -> bool:
    return abs(predicted - truth) <= BLOCK


def report(calls: list[Call]) -> str:
    lines = []
    for arm in ("events", "estimate"):
        decided = [
            c
            for c in calls
            if c.arm == arm
            and c.outcome == Outcome.DECODE_ONLY.value
            and c.predicted is not None
            and c.truth is not None
        ]
        if not decided:
            lines.append(f"{arm}: no decode-only decisions")
            continue
        near = sum(within(c.predicted, c.truth) for c in decided)  # type: ignore[arg-type]
        exact = sum(c.predicted == c.truth for c in decided)
        over = [c.predicted - c.truth for c in decided if c.predicted > c.truth]  # type: ignore[operator]
        sources = {s: sum(c.cache_source == s for c in decided) for s in ("kv_events", "estimate")}
        lines.append(
            f"{arm}: {len(decided)} decode-only decisions; within one block of the decode's own count "
            f"{near}/{len(decided)} = {near / len(decided):.2f}, exact {exact}/{len(decided)}; "
            f"over-counted {len(over)} (at most {max(over, default=0)} tokens); decided by {sources}"
        )
    mine = [c for c in calls if c.arm == "events"]
    handed = [c for c in mine if c.outcome == Outcome.DISAGGREGATED.value and c.estimator_decode_only]
    lines.append(
        f"events arm: {len(handed)} calls handed off by the events that the estimator would have sent "
        f"decode-only (its cached count for them: {[c.estimator for c in handed]}; the events': "
        f"{[c.predicted for c in handed]})"
    )
    beside_decided = [c for c in mine if c.outcome == Outcome.DECODE_ONLY.value and c.truth is not None]
    if beside_decided:
        near = sum(c.estimator is not None and within(c.estimator, c.truth) for c in beside_decided)  # type: ignore[arg-type]
        lines.append(
            f"the estimator beside, on the events arm's decode-only calls: within one block "
            f"{near}/{len(beside_decided)} = {near / len(beside_decided):.2f}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8, help="per arm")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--blocks", type=int, default=64, help="KV cache blocks a server (128 tokens each)")
    parser.add_argument("--system-words", type=int, default=450)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="the per-call records as JSON")
    args = parser.parse_args()
    started = time.monotonic()
    with LocalPD(kv_events=True, extra_server_args=["--num-gpu-blocks-override", str(args.blocks)]) as pd:
        print(f"pair up in {time.monotonic() - started:.0f} s", file=sys.stderr)
        calls = run(pd, args)
    if args.out is not None:
        args.out.write_text(json.dumps([asdict(c) for c in calls], indent=1) + "\n")
    print(
        f"{args.conversations} conversations x {args.turns} turns per arm, KV cache {args.blocks} blocks "
        f"({args.blocks * BLOCK} tokens) a server, answers of {args.max_tokens} tokens"
    )
    print(report(calls))
    return 0


if __name__ == "__main__":
    sys.exit(main())
