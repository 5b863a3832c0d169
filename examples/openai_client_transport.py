"""Keep your own openai.OpenAI / AsyncOpenAI: give it an httpx client built on PDTransport.

Any code (or framework) that accepts ``http_client=`` gets the P/D handoff this way; the
client's ``base_url`` must be the decode server, where every non-chat request goes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import httpx
import openai
from _pair import pd_pair

from pdclient import AsyncPDTransport, PDTransport


def sync_call(prefill_urls: Sequence[str], decode_urls: Sequence[str], model: str) -> None:
    transport = PDTransport(prefill_base_url=prefill_urls, decode_base_url=decode_urls)
    client = openai.OpenAI(base_url=decode_urls[0], api_key="EMPTY", http_client=httpx.Client(transport=transport))
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the capital of Italy?"}], max_tokens=16
    )
    print("sync: ", reply.choices[0].message.content)
    print("models via decode:", [m.id for m in client.models.list()])


async def async_call(prefill_urls: Sequence[str], decode_urls: Sequence[str], model: str) -> None:
    transport = AsyncPDTransport(prefill_base_url=prefill_urls, decode_base_url=decode_urls)
    async with openai.AsyncOpenAI(
        base_url=decode_urls[0], api_key="EMPTY", http_client=httpx.AsyncClient(transport=transport)
    ) as client:
        reply = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is the capital of Spain?"}], max_tokens=16
        )
        print("async:", reply.choices[0].message.content)


def main() -> None:
    with pd_pair() as pair:
        sync_call(pair.prefill_urls, pair.decode_urls, pair.model)
        asyncio.run(async_call(pair.prefill_urls, pair.decode_urls, pair.model))


if __name__ == "__main__":
    main()
