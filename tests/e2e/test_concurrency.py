"""Twenty concurrent async P/D calls with distinct prompts each get their own answer.

"Their own" is judged against the decode server's answers to the same prompts, also run
concurrently, without P/D. Exact equality for every call is too strict here: greedy
decoding on CPU bf16 is not batch-invariant (on this machine 2 of these 20 answers
differ between a batched and a one-by-one run of the same plain server, after the first
~8 tokens). So each answer must name its own city and no other, share a longer prefix
with its own reference than with any other prompt's, and most must match exactly.
"""

from __future__ import annotations

import asyncio

import openai

from pdclient import PDTrace
from pdclient.local import PDServers

from .helpers import GREEDY, user

CITIES = [
    "Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Athens", "Dublin",
    "Oslo", "Stockholm", "Helsinki", "Budapest", "Brussels", "Amsterdam", "Copenhagen", "Bern", "Tokyo", "Cairo",
]  # fmt: skip


def _common_prefix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def test_twenty_concurrent_calls_get_their_own_answers(pd: PDServers) -> None:
    questions = [f"In which country is the city of {city}? Answer in one sentence." for city in CITIES]
    traces: list[PDTrace] = []

    async def ask(client: openai.AsyncOpenAI, question: str) -> str:
        r = await client.chat.completions.create(model=pd.model, messages=user(question), **GREEDY)
        return r.choices[0].message.content or ""

    async with pd.async_client(on_trace=traces.append, timeout=240) as client:
        got = await asyncio.gather(*(ask(client, q) for q in questions))
    # The reference answers, also concurrent (batched), from the decode server alone.
    async with openai.AsyncOpenAI(base_url=pd.decode_url, api_key="EMPTY", timeout=240) as plain:
        expected = await asyncio.gather(*(ask(plain, q) for q in questions))

    assert len(set(expected)) == len(questions), "the probe needs distinct answers"
    for i, answer in enumerate(got):
        assert CITIES[i] in answer and not any(c in answer for c in CITIES if c != CITIES[i]), (questions[i], answer)
        own = _common_prefix(answer, expected[i])
        others = max(_common_prefix(answer, e) for j, e in enumerate(expected) if j != i)
        assert own > others, (questions[i], answer, expected[i])
    exact = sum(g == e for g, e in zip(got, expected, strict=True))
    assert exact >= len(questions) * 3 // 4, f"only {exact}/{len(questions)} answers match exactly"
    assert len(traces) == len(questions)
    assert all(t.fallback is None and t.forwarded_tokens > 0 for t in traces)
    assert len({t.request_id for t in traces}) == len(questions)
