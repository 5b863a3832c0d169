"""Twenty concurrent async P/D calls with distinct prompts: no call gets another's ids.

Proven from the ids themselves and the servers' own tokenizer, never from what the model
answers (greedy decoding on CPU bf16 is neither batch-invariant nor the same on every
CPU): each decode leg must carry exactly the token ids the decode server's own
``/tokenize`` gives for that call's messages, each call its own request id end to end.
"""

from __future__ import annotations

import asyncio
import json

import httpx

from pdclient import CallView, LegView, PDObserver, PDTrace
from pdclient.local import PDServers

from .helpers import GREEDY, user

CITIES = [
    "Paris", "Berlin", "Madrid", "Rome", "Lisbon", "Vienna", "Prague", "Warsaw", "Athens", "Dublin",
    "Oslo", "Stockholm", "Helsinki", "Budapest", "Brussels", "Amsterdam", "Copenhagen", "Bern", "Tokyo", "Cairo",
]  # fmt: skip


class DecodeBodies(PDObserver):
    """Records what each call's decode leg carried, by request id."""

    def __init__(self) -> None:
        self.sent: dict[str, dict[str, object]] = {}

    def on_leg_start(self, call: CallView, leg: LegView) -> None:
        if leg.name == "decode":
            self.sent[call.request_id] = json.loads(leg.request.content)


async def test_twenty_concurrent_calls_carry_their_own_ids(pd: PDServers) -> None:
    questions = [f"In which country is the city of {city}? Answer in one sentence." for city in CITIES]
    traces: list[PDTrace] = []
    decodes = DecodeBodies()

    async def ask(question: str) -> str | None:
        r = await client.chat.completions.create(model=pd.model, messages=user(question), **GREEDY)
        return r.choices[0].finish_reason

    async with pd.async_client(on_trace=traces.append, observers=[decodes], timeout=240) as client:
        endings = await asyncio.gather(*(ask(q) for q in questions))
    assert set(endings) <= {"stop", "length"}, "every call got a whole answer"
    assert len(traces) == len(questions) and len({t.request_id for t in traces}) == len(questions)
    assert all(t.fallback is None and t.forwarded_tokens > 0 for t in traces)

    root = pd.decode_url.removesuffix("/v1")
    async with httpx.AsyncClient(timeout=60) as http:
        for trace in traces:
            sent = decodes.sent[trace.request_id]
            messages = sent["messages"]
            tokenized = await http.post(
                f"{root}/tokenize", json={"model": pd.model, "messages": messages, "add_generation_prompt": True}
            )
            tokenized.raise_for_status()
            forwarded = sent["kv_transfer_params"]["prompt_token_ids"]  # type: ignore[index]
            assert forwarded == tokenized.json()["tokens"], f"{trace.request_id} got ids that are not its own"
            assert len(forwarded) == trace.forwarded_tokens
