"""LiteLLM on the P/D clients: pass PDChatClient / AsyncPDChatClient as ``client=``.

Needs ``pip install litellm``. LiteLLM's OpenAI-compatible provider calls the client it
is given, so each completion is one P/D handoff.
"""

from __future__ import annotations

import asyncio
import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no price-list download at import

import litellm
from _pair import pd_pair

from pdclient import AsyncPDChatClient, PDChatClient


def main() -> None:
    with pd_pair() as pair:
        urls = {"prefill_base_url": pair.prefill_urls, "decode_base_url": pair.decode_urls, "api_key": "EMPTY"}
        messages = [{"role": "user", "content": "What is the capital of Germany?"}]
        reply = litellm.completion(
            model=f"openai/{pair.model}", messages=messages, max_tokens=16, client=PDChatClient(**urls)
        )
        print("completion:", reply.choices[0].message.content)

        async def stream() -> str:
            chunks = await litellm.acompletion(
                model=f"openai/{pair.model}",
                messages=messages,
                max_tokens=16,
                stream=True,
                client=AsyncPDChatClient(**urls),
            )
            return "".join([c.choices[0].delta.content or "" async for c in chunks])

        print("async stream:", asyncio.run(stream()))


if __name__ == "__main__":
    main()
