"""LiteLLM on the P/D clients: ``litellm.completion(..., client=PDChatClient(...))``.

LiteLLM's OpenAI-compatible provider takes an ``openai.OpenAI`` / ``AsyncOpenAI`` as
``client=`` and calls it through ``with_raw_response``; PDChatClient is one, so every call
becomes a P/D handoff. (LlamaIndex's OpenAILike is not tested: llama-index-llms-openai pins
openai<3; see the README.)
"""

from __future__ import annotations

import os

import pytest

from pdclient import AsyncPDChatClient, PDChatClient

from .conftest import DECODE, MODEL, PREFILL, FakePair

# LiteLLM fetches a model price list from the internet at import unless told not to.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
litellm = pytest.importorskip("litellm")

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def sync_client() -> PDChatClient:
    return PDChatClient(prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="EMPTY", max_retries=0)


def async_client() -> AsyncPDChatClient:
    return AsyncPDChatClient(prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="EMPTY", max_retries=0)


def test_completion(fake_pair: FakePair) -> None:
    reply = litellm.completion(model=f"openai/{MODEL}", messages=MESSAGES, client=sync_client())
    assert reply.choices[0].message.content == fake_pair.answer
    fake_pair.assert_handoffs(1)


async def test_acompletion(fake_pair: FakePair) -> None:
    reply = await litellm.acompletion(model=f"openai/{MODEL}", messages=MESSAGES, client=async_client())
    assert reply.choices[0].message.content == fake_pair.answer
    fake_pair.assert_handoffs(1)


def test_stream(fake_pair: FakePair) -> None:
    stream = litellm.completion(model=f"openai/{MODEL}", messages=MESSAGES, client=sync_client(), stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream]
    assert len([p for p in pieces if p]) > 1
    assert "".join(pieces) == fake_pair.answer
    fake_pair.assert_handoffs(1)


async def test_astream(fake_pair: FakePair) -> None:
    stream = await litellm.acompletion(model=f"openai/{MODEL}", messages=MESSAGES, client=async_client(), stream=True)
    pieces = [chunk.choices[0].delta.content or "" async for chunk in stream]
    assert "".join(pieces) == fake_pair.answer
    fake_pair.assert_handoffs(1)


def test_tool_call(fake_pair: FakePair) -> None:
    reply = litellm.completion(
        model=f"openai/{MODEL}",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        client=sync_client(),
    )
    call = reply.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather"
    fake_pair.assert_handoffs(1)
    assert fake_pair.prefill_bodies[0]["tools"] == TOOLS
