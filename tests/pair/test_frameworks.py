"""The frameworks on the real local pair (vLLM on CPU, KV moved by NIXL), not on mocks.

Each framework answers the same through P/D as through the decode server alone (greedy),
and every call was a token-reusing handoff (``forwarded_tokens > 0``, no fallback).
SmolLM2-135M is too small to fill a tool's arguments by their schema (asked for
``get_weather(city)`` it answers ``"Paris"``, not ``{"city": "Paris"}``), so on the real
pair the tool tests check that a tools request goes through the handoff and comes back as
a call of the named tool; complete tool loops are proven on the respx fake pair
(test_langchain.py, test_openai_agents.py, test_litellm.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pdclient import PDTrace
from pdclient.local import PDServers
from pdclient.otel import instrument

from ._pair import WEATHER_TOOL, Pair
from .helpers import agent_outcome

QUESTION = "What is the capital of France?"
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def pair(pd: PDServers) -> Pair:
    return Pair.of(pd)


@pytest.fixture
def traces() -> list[PDTrace]:
    return []


def all_reused(traces: list[PDTrace], calls: int) -> None:
    assert len(traces) == calls, traces
    for trace in traces:
        assert trace.fallback is None, trace
        assert trace.forwarded_tokens > 0, trace


# -- LangChain ------------------------------------------------------------------------------


def langchain_models(pair: Pair, traces: list[PDTrace], **kwargs: Any) -> tuple[Any, Any]:
    langchain_openai = pytest.importorskip("langchain_openai")
    sync, async_ = pair.client(on_trace=traces.append), pair.async_client(on_trace=traces.append)
    options = {"model": pair.model, "temperature": 0, "max_tokens": MAX_TOKENS, **kwargs}
    pd = langchain_openai.ChatOpenAI(
        root_client=sync,
        client=sync.chat.completions,
        root_async_client=async_,
        async_client=async_.chat.completions,
        **options,
    )
    plain = langchain_openai.ChatOpenAI(base_url=pair.decode_url, api_key="EMPTY", **options)
    return pd, plain


def test_langchain_invoke_and_stream(pair: Pair, traces: list[PDTrace]) -> None:
    pd, plain = langchain_models(pair, traces)
    expected = plain.invoke(QUESTION).content
    assert pd.invoke(QUESTION).content == expected

    # Streamed chunk for chunk as the decode server streams it, however long this CPU's answer is.
    def streamed(model: Any) -> list[object]:
        return [c.content for c in model.stream(QUESTION) if c.content]

    assert streamed(pd) == streamed(plain)
    all_reused(traces, 2)


async def test_langchain_async(pair: Pair, traces: list[PDTrace]) -> None:
    pd, plain = langchain_models(pair, traces)
    expected = (await plain.ainvoke(QUESTION)).content
    assert (await pd.ainvoke(QUESTION)).content == expected
    streamed = [c async for c in pd.astream(QUESTION)]
    assert "".join(str(c.content) for c in streamed) == expected
    all_reused(traces, 2)


def test_tool_call_through_the_handoff(pair: Pair, traces: list[PDTrace]) -> None:
    """A tools request renders the tools on both legs and comes back as a call of the named tool.

    The frameworks' own tool handling is not exercised here: SmolLM2-135M answers
    ``arguments: "Paris"`` (not an object), which LangChain rejects (AIMessage validation)
    and the Agents SDK reports as invalid tool input. Their tool loops run on the respx
    fake pair instead.
    """
    if not pair.supports_tools:
        pytest.skip("the pair's servers run without --tool-call-parser; vLLM refuses tools requests")
    request: dict[str, Any] = {
        "model": pair.model,
        "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        "max_tokens": 48,
        "temperature": 0,
    }
    expected = openai.OpenAI(base_url=pair.decode_url, api_key="EMPTY").chat.completions.create(**request)
    reply = pair.client(on_trace=traces.append).chat.completions.create(**request)

    # The named tool_choice makes vLLM answer with a call of that tool; its arguments are what
    # this CPU's greedy decoding gives, so they are compared with the decode server's own.
    def calls(completion: Any) -> list[tuple[str, str]]:
        return [(c.function.name, c.function.arguments) for c in completion.choices[0].message.tool_calls or []]

    assert calls(reply) == calls(expected)
    assert [name for name, _ in calls(expected)] == ["get_weather"]
    all_reused(traces, 1)


# -- OpenAI Agents SDK ------------------------------------------------------------------------


async def test_agents_sdk_agent(pair: Pair, traces: list[PDTrace]) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return f"sunny in {city}"

    tools = [get_weather] if pair.supports_tools else []
    settings = agents.ModelSettings(temperature=0, max_tokens=MAX_TOKENS)

    def agent(client: openai.AsyncOpenAI) -> Any:
        model = agents.OpenAIChatCompletionsModel(model=pair.model, openai_client=client)
        return agents.Agent(
            name="assistant", instructions="Answer briefly.", tools=tools, model=model, model_settings=settings
        )

    plain = openai.AsyncOpenAI(base_url=pair.decode_url, api_key="EMPTY")
    expected = await agent_outcome(agents, agent(plain), QUESTION)
    assert await agent_outcome(agents, agent(pair.async_client(on_trace=traces.append)), QUESTION) == expected
    assert traces  # one model call, more where this CPU's model calls the tool
    all_reused(traces, len(traces))


# -- LiteLLM ---------------------------------------------------------------------------------


def test_litellm(pair: Pair, traces: list[PDTrace]) -> None:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    litellm = pytest.importorskip("litellm")
    options = {"model": f"openai/{pair.model}", "messages": [{"role": "user", "content": QUESTION}]}
    options |= {"temperature": 0, "max_tokens": MAX_TOKENS}
    plain = openai.OpenAI(base_url=pair.decode_url, api_key="EMPTY")
    expected = litellm.completion(client=plain, **options).choices[0].message.content
    client = pair.client(on_trace=traces.append)
    assert litellm.completion(client=client, **options).choices[0].message.content == expected
    stream = litellm.completion(client=client, stream=True, **options)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected
    all_reused(traces, 2)


# -- OpenTelemetry ---------------------------------------------------------------------------


@pytest.fixture
def spans() -> Iterator[Any]:
    pytest.importorskip("opentelemetry.instrumentation.openai_v2")
    from opentelemetry.instrumentation.openai_v2 import OpenAIInstrumentor
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    OpenAIInstrumentor().instrument(tracer_provider=provider)
    yield provider, exporter
    OpenAIInstrumentor().uninstrument()
    provider.shutdown()


def test_one_generation_per_call_and_pdclient_spans(pair: Pair, traces: list[PDTrace], spans: Any) -> None:
    provider, exporter = spans
    client = instrument(pair.client(on_trace=traces.append), tracer_provider=provider)
    messages = [{"role": "user", "content": QUESTION}]
    client.chat.completions.create(model=pair.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    stream = client.chat.completions.create(
        model=pair.model, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    for _ in stream:
        pass
    all_reused(traces, 2)
    finished = exporter.get_finished_spans()
    generations = [s for s in finished if (s.attributes or {}).get("gen_ai.operation.name") == "chat"]
    assert len(generations) == 2
    calls = [s for s in finished if s.name == "pdclient.chat"]
    assert len(calls) == 2
    for call, generation, trace in zip(calls, generations, traces, strict=True):
        assert call.parent is not None and call.parent.span_id == generation.context.span_id
        attrs = call.attributes or {}
        assert attrs["pdclient.request_id"] == trace.request_id
        assert attrs["pdclient.forwarded_tokens"] == trace.forwarded_tokens > 0
        assert attrs["pdclient.prefill_url"] == pair.prefill_url
    legs = sorted(s.name for s in finished if s.name in ("pdclient.prefill", "pdclient.decode"))
    assert legs == ["pdclient.decode"] * 2 + ["pdclient.prefill"] * 2
