"""``remote_prefill="auto"`` on the real pair (issue 11): a follow-up turn goes decode-only and is cached.

The first turn of a conversation (a long, unique system message) goes through a P/D
handoff; its follow-up (the answer sent back and a short question) goes decode-only to
the decode server, whose prefix cache answers most of it, and the prefill server is not
asked at all. The answers are compared with the decode server's own, never with what the
model knows.
"""

from __future__ import annotations

import uuid
from typing import Any

import openai

from pdclient import Outcome, PDTrace
from pdclient.local import PDServers

from .helpers import GREEDY, WITH_LOGPROBS, metric, same_greedy_answer, tops

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


def test_an_auto_follow_up_goes_decode_only_and_the_decode_servers_cache_answers_it(
    pd: PDServers, plain: openai.OpenAI
) -> None:
    system = f"Conversation {uuid.uuid4().hex}. " + "Notes: the robot paints in the morning and sleeps at noon. " * 40
    turn1: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Tell me a short story about the robot in the notes."},
    ]
    traces: list[PDTrace] = []
    with pd.client(remote_prefill="auto", on_trace=traces.append) as client:
        stream = client.chat.completions.create(
            model=pd.model, messages=turn1, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
        answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Give it a title."}]
        decode_before = {name: metric(pd.decode_url, name) for name in (HITS, QUERIES)}
        prefill_before = metric(pd.prefill_url, QUERIES)
        follow_up = client.chat.completions.create(model=pd.model, messages=turn2, **GREEDY, **WITH_LOGPROBS)
        decode_after = {name: metric(pd.decode_url, name) for name in (HITS, QUERIES)}
        prefill_after = metric(pd.prefill_url, QUERIES)
    first, second = traces
    assert first.outcome is Outcome.DISAGGREGATED and first.forwarded_tokens > 0
    assert (second.outcome, second.remote_prefill, second.remote_prefill_reason, second.conversation) == (
        Outcome.DECODE_ONLY,
        False,
        "mostly_cached",
        "extends_answer",
    )
    assert second.decode_url == pd.decode_url and second.prefill_url is None
    assert prefill_after == prefill_before, "the prefill server was asked for the follow-up"
    hits = decode_after[HITS] - decode_before[HITS]
    queries = decode_after[QUERIES] - decode_before[QUERIES]
    assert queries > 0 and hits / queries >= 0.7, (hits, queries)
    # What the client estimated as uncached covers what the server did not find cached.
    assert second.estimated_uncached_tokens is not None and second.estimated_uncached_tokens >= queries - hits
    # The decode server's own answer to the same request (its cache is warm either way).
    reference = plain.chat.completions.create(model=pd.model, messages=turn2, **GREEDY, **WITH_LOGPROBS)  # type: ignore[arg-type]
    print("\nthe decode-only follow-up and the decode server's own answer:", end=" ")
    print(same_greedy_answer(tops(follow_up.choices[0].logprobs), tops(reference.choices[0].logprobs)))
