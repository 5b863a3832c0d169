"""LangChain's ChatOpenAI over the P/D handoff: invoke, stream and async stream.

Needs ``pip install langchain-openai``. ChatOpenAI's public ``http_client`` /
``http_async_client`` arguments take httpx clients built on the P/D transports; its
``base_url`` is a decode URL, where every non-P/D request goes. (ChatOpenAI also takes
ready openai clients through its ``root_client`` / ``client`` fields; the public
arguments are the stable way.)
"""

from __future__ import annotations

import asyncio

import httpx
from _pair import pd_pair
from langchain_openai import ChatOpenAI

from pdclient import AsyncPDTransport, PDTransport


def main() -> None:
    with pd_pair() as pair:
        urls = {"prefill_base_url": pair.prefill_urls, "decode_base_url": pair.decode_urls}
        llm = ChatOpenAI(
            model=pair.model,
            base_url=pair.decode_url,
            api_key="EMPTY",
            temperature=0,
            max_tokens=32,
            http_client=httpx.Client(transport=PDTransport(**urls)),
            http_async_client=httpx.AsyncClient(transport=AsyncPDTransport(**urls)),
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
