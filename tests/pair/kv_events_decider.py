"""One client process of the agreement test (tests/pair/test_kv_events.py): runs a
conversation's turns through its own PDChatClient (``remote_prefill="auto"``,
``kv_events="discover"``) and prints each turn's decision as one JSON line.

    python -m tests.pair.kv_events_decider PREFILL_URL DECODE_URL MODEL < turns.json

``turns.json``: the first call's messages, then the follow-up questions; each follow-up
carries the answer before it. Before each follow-up it waits until the decode's events
have been quiet for a moment (the previous answer's blocks are in its index).
"""

from __future__ import annotations

import json
import sys
import time

from pdclient import PDChatClient, PDTrace
from pdclient.kv_events import KVIndex


def settled(index: KVIndex, quiet: float = 0.5, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    last, since = index.last_seq, time.monotonic()
    while time.monotonic() - since < quiet:
        if time.monotonic() > deadline:
            raise SystemExit("the decode's events never went quiet")
        time.sleep(0.05)
        if index.last_seq != last:
            last, since = index.last_seq, time.monotonic()


def main(prefill: str, decode: str, model: str) -> int:
    messages, *questions = json.load(sys.stdin)
    traces: list[PDTrace] = []
    with PDChatClient(
        prefill_base_url=prefill,
        decode_base_url=decode,
        api_key="EMPTY",
        remote_prefill="auto",
        kv_events="discover",
        on_trace=traces.append,
    ) as client:
        client.pd_fleet.start()
        feeds = client.pd_fleet.kv_events
        assert feeds is not None
        deadline = time.monotonic() + 60
        while (index := feeds.index(decode)) is None or not index.synced:
            if time.monotonic() > deadline:
                raise SystemExit("the decode's view never synced")
            time.sleep(0.05)
        said: str | None = None
        for number in range(len(questions) + 1):
            if number:
                messages = [
                    *messages,
                    {"role": "assistant", "content": said},
                    {"role": "user", "content": questions[number - 1]},
                ]
                settled(index)
            answer = client.chat.completions.create(model=model, messages=messages, temperature=0, max_tokens=150)
            said = answer.choices[0].message.content
            trace = traces[-1]
            details = answer.usage.prompt_tokens_details if answer.usage else None
            line = {
                "outcome": trace.outcome.value if trace.outcome else None,
                "cache_source": trace.cache_source,
                "cached_tokens": trace.cached_tokens,
                "decode_cached_tokens": details.cached_tokens if details else None,
                "answer": said,
            }
            print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
