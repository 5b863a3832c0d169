"""Many concurrent calls: each decode leg receives the ids of its own prompt, never another's."""

from __future__ import annotations

import asyncio
import json

import httpx
import respx

from pdclient import AsyncPDChatClient, PDTrace
from tests.fake_vllm import DECODE, PREFILL, chat_json, ids_for, prefill_json

CALLS = 256


async def test_concurrent_calls_never_mix_ids() -> None:
    mismatches: list[str] = []

    async def prefill(request: httpx.Request) -> httpx.Response:
        await asyncio.sleep(0.001 * (hash(request.content) % 7))  # finish out of order
        return httpx.Response(200, json=prefill_json(json.loads(request.content)))

    async def decode(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        prompt = body["messages"][-1]["content"]
        if body["kv_transfer_params"]["prompt_token_ids"] != ids_for(prompt):
            mismatches.append(prompt)
        await asyncio.sleep(0.001 * (len(prompt) % 5))
        return httpx.Response(200, json=chat_json(f"answer to {prompt}"))

    traces: list[PDTrace] = []
    with respx.mock(assert_all_called=True) as router:
        router.post(f"{PREFILL}/chat/completions", name="prefill").mock(side_effect=prefill)
        router.post(f"{DECODE}/chat/completions", name="decode").mock(side_effect=decode)
        client = AsyncPDChatClient(
            prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="k", on_trace=traces.append
        )

        async def one(i: int) -> tuple[str, str | None]:
            prompt = f"question number {i} " + "x" * (i % 13)
            completion = await client.chat.completions.create(model="m", messages=[{"role": "user", "content": prompt}])
            return prompt, completion.choices[0].message.content

        results = await asyncio.gather(*(one(i) for i in range(CALLS)))
        await client.close()
        assert router["prefill"].call_count == CALLS and router["decode"].call_count == CALLS

    assert mismatches == []
    assert all(answer == f"answer to {prompt}" for prompt, answer in results)
    assert len({t.request_id for t in traces}) == CALLS
