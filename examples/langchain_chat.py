"""LangChain's ChatOpenAI on the P/D clients: invoke, stream and async stream.

Needs ``pip install langchain-openai``. The recipe to start from uses ChatOpenAI's public
arguments: ``ChatOpenAI(base_url=<decode>, http_client=httpx.Client(transport=PDTransport(...)),
http_async_client=httpx.AsyncClient(transport=AsyncPDTransport(...)))``. This example
hands ChatOpenAI the P/D clients themselves instead (its ``root_client`` / ``client``
fields and their async twins), which keeps the clients' own options (``on_trace``,
``with_options``) in LangChain's calls.
"""

from __future__ import annotations

import asyncio

from _pair import pd_pair
from langchain_openai import ChatOpenAI

from pdclient import AsyncPDChatClient, PDChatClient


def main() -> None:
    with pd_pair() as pair:
        urls = {"prefill_base_url": pair.prefill_urls, "decode_base_url": pair.decode_urls, "api_key": "EMPTY"}
        sync, async_ = PDChatClient(**urls), AsyncPDChatClient(**urls)
        llm = ChatOpenAI(
            model=pair.model,
            temperature=0,
            max_tokens=32,
            root_client=sync,
            client=sync.chat.completions,
            root_async_client=async_,
            async_client=async_.chat.completions,
        )
        print("invoke:", llm.invoke("What is the capital of France?").content)
        print("stream: ", end="")
        for chunk in llm.stream("Name three fruits."):
            print(chunk.content, end="", flush=True)
        print()

        async def astream() -> str:
            return "".join([str(c.content) async for c in llm.astream("Name a planet.")])

        print("astream:", asyncio.run(astream()))


if __name__ == "__main__":
    main()
