"""One test body for both clients: ``Twin(mode)`` wraps PDChatClient or AsyncPDChatClient."""

from __future__ import annotations

from typing import Any

import openai

from pdclient import AsyncPDChatClient, PDChatClient
from tests.fake_vllm import DECODE, PREFILL


class Twin:
    def __init__(self, mode: str, **kwargs: Any) -> None:
        kwargs.setdefault("prefill_base_url", PREFILL)
        kwargs.setdefault("decode_base_url", DECODE)
        kwargs.setdefault("api_key", "sk-test")
        kwargs.setdefault("max_retries", 0)
        self.mode = mode
        self.client: PDChatClient | AsyncPDChatClient = (PDChatClient if mode == "sync" else AsyncPDChatClient)(
            **kwargs
        )

    async def call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        return await result if self.mode == "async" else result

    async def chat(self, client: Any = None, **kwargs: Any) -> Any:
        client = client or self.client
        kwargs.setdefault("model", "m")
        return await self.call(client.chat.completions.create, **kwargs)

    async def stream_text(self, client: Any = None, **kwargs: Any) -> list[str]:
        """The content pieces of a streamed answer, one per chunk that carried content."""
        stream = await self.chat(client, stream=True, **kwargs)
        chunks = list(stream) if self.mode == "sync" else [c async for c in stream]
        return [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content is not None]

    async def close(self) -> None:
        await self.call(self.client.close)


def status_error(excinfo: Any) -> openai.APIStatusError:
    assert isinstance(excinfo.value, openai.APIStatusError)
    return excinfo.value
