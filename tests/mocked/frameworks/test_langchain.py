"""LangChain's ChatOpenAI on the P/D clients: invoke, stream, a tool call, faults.

Two recipes, both supported by langchain-openai without any adapter:
- the P/D clients themselves (``root_client=`` / ``client=`` and their async twins);
- ``http_client=`` / ``http_async_client=`` built on ``PDTransport`` plus ``base_url=``.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx
import pytest

from pdclient import AsyncPDChatClient, AsyncPDTransport, PDChatClient, PDTrace, PDTransport

from .conftest import DECODE, MODEL, PREFILL, FakePair

pytest.importorskip("langchain_openai")

from langchain_core.messages import AIMessage, AIMessageChunk
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def chat_on_clients(traces: list[PDTrace] | None = None, **kwargs: Any) -> ChatOpenAI:
    """Recipe 1: hand LangChain the P/D clients."""
    pd_args: dict[str, Any] = {"prefill_base_url": PREFILL, "decode_base_url": DECODE, "api_key": "EMPTY"}
    if traces is not None:
        pd_args["on_trace"] = traces.append
    sync, async_ = PDChatClient(**pd_args), AsyncPDChatClient(**pd_args)
    return ChatOpenAI(
        model=MODEL,
        root_client=sync,
        client=sync.chat.completions,
        root_async_client=async_,
        async_client=async_.chat.completions,
        **kwargs,
    )


def chat_on_transport(**kwargs: Any) -> ChatOpenAI:
    """Recipe 2: hand LangChain httpx clients whose transport does the handoff."""
    return ChatOpenAI(
        model=MODEL,
        base_url=DECODE,
        api_key="EMPTY",  # type: ignore[arg-type]
        http_client=httpx.Client(transport=PDTransport(prefill_base_url=PREFILL, decode_base_url=DECODE)),
        http_async_client=httpx.AsyncClient(
            transport=AsyncPDTransport(prefill_base_url=PREFILL, decode_base_url=DECODE)
        ),
        **kwargs,
    )


RECIPES = pytest.mark.parametrize("make", [chat_on_clients, chat_on_transport], ids=["clients", "http_client"])


@RECIPES
def test_invoke(fake_pair: FakePair, make: Any) -> None:
    reply = make().invoke("What is the capital of France?")
    assert isinstance(reply, AIMessage)
    assert reply.content == fake_pair.answer
    fake_pair.assert_handoffs(1)


@RECIPES
async def test_ainvoke(fake_pair: FakePair, make: Any) -> None:
    reply = await make().ainvoke("What is the capital of France?")
    assert reply.content == fake_pair.answer
    fake_pair.assert_handoffs(1)


@RECIPES
def test_stream(fake_pair: FakePair, make: Any) -> None:
    chunks = list(make().stream("What is the capital of France?"))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    assert len([c for c in chunks if c.content]) > 1, "streamed, not one blob"
    assert "".join(str(c.content) for c in chunks) == fake_pair.answer
    fake_pair.assert_handoffs(1)
    assert fake_pair.decode_bodies[0]["stream"] is True


@RECIPES
async def test_astream(fake_pair: FakePair, make: Any) -> None:
    chunks = [c async for c in make().astream("What is the capital of France?")]
    assert "".join(str(c.content) for c in chunks) == fake_pair.answer
    fake_pair.assert_handoffs(1)


def test_stream_usage_reaches_langchain(fake_pair: FakePair) -> None:
    """stream_usage adds stream_options to the caller's body: the decode leg keeps it, prefill drops it."""
    chunks = list(chat_on_clients(stream_usage=True).stream("hi"))
    total = sum((c for c in chunks[1:]), chunks[0])
    assert isinstance(total, AIMessageChunk) and total.usage_metadata is not None
    decode = fake_pair.decode_bodies[0]
    assert (
        total.usage_metadata["total_tokens"] == fake_pair.answers.usage("/v1/chat/completions", decode)["total_tokens"]
    )
    assert "stream_options" not in fake_pair.prefill_bodies[0]
    assert fake_pair.decode_bodies[0]["stream_options"] == {"include_usage": True}


@RECIPES
def test_tool_call(fake_pair: FakePair, make: Any) -> None:
    """bind_tools: the tools shape the rendered prompt, so both legs get them unchanged."""
    llm = make().bind_tools([get_weather], tool_choice="get_weather")
    reply = llm.invoke("What is the weather in Paris?")
    assert reply.tool_calls == [{"name": "get_weather", "args": {"city": "Paris"}, "id": "call_1", "type": "tool_call"}]
    fake_pair.assert_handoffs(1)
    prefill, decode = fake_pair.prefill_bodies[0], fake_pair.decode_bodies[0]
    assert prefill["tools"] == decode["tools"] and prefill["tools"][0]["function"]["name"] == "get_weather"
    assert prefill["tool_choice"] == decode["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


async def test_tool_loop_async(fake_pair: FakePair) -> None:
    """A full tool round trip: the tool result goes back as a second P/D call."""
    llm = chat_on_clients().bind_tools([get_weather])
    question = ("user", "What is the weather in Paris?")
    first = await llm.ainvoke([question])
    assert first.tool_calls[0]["name"] == "get_weather"
    result = await get_weather.ainvoke(first.tool_calls[0])
    second = await llm.ainvoke([question, first, result])
    assert second.content == fake_pair.answer
    fake_pair.assert_handoffs(2)
    assert fake_pair.decode_bodies[1]["messages"][-1] == {
        "role": "tool",
        "content": "sunny in Paris",
        "tool_call_id": "call_1",
    }


def test_stream_tool_call(fake_pair: FakePair) -> None:
    chunks = list(chat_on_clients().bind_tools([get_weather], tool_choice="get_weather").stream("Weather in Paris?"))
    total = sum((c for c in chunks[1:]), chunks[0])
    assert isinstance(total, AIMessageChunk)
    assert total.tool_calls[0]["args"] == {"city": "Paris"}


def test_traces_reach_on_trace(fake_pair: FakePair) -> None:
    traces: list[PDTrace] = []
    chat_on_clients(traces).invoke("hi")
    list(chat_on_clients(traces).stream("hi"))
    assert [t.route for t in traces] == ["chat", "chat"]
    assert all(t.forwarded_tokens > 0 and t.fallback is None for t in traces)


def test_prefill_down_falls_back_to_decode(prefill_down: FakePair, caplog: pytest.LogCaptureFixture) -> None:
    """A prefill outage is invisible to LangChain (policy "decode"); pdclient logs a WARNING."""
    with caplog.at_level(logging.WARNING, logger="pdclient"):
        reply = chat_on_clients(max_retries=0).invoke("hi")
    assert reply.content == prefill_down.answer
    assert "kv_transfer_params" not in prefill_down.decode_bodies[0]
    assert any("prefill failed" in r.getMessage() for r in caplog.records if r.name == "pdclient")


def test_decode_error_is_an_openai_error_in_langchain(fake_pair: FakePair) -> None:
    """A decode 400 reaches LangChain as openai.BadRequestError, naming the failed leg."""
    import openai

    fake_pair.router.routes["decode"].mock(
        return_value=httpx.Response(400, json={"error": {"message": "bad", "type": "invalid_request_error"}})
    )
    with pytest.raises(openai.BadRequestError) as info:
        chat_on_clients(max_retries=0).invoke("hi")
    assert info.value.response.headers["x-pd-failed-leg"] == "decode"
