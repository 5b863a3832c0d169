"""The OpenAI Agents SDK on AsyncPDChatClient (chat-completions model): an agent with a function tool.

openai-agents 0.24 requires openai>=3, so this runs on the same openai as pdclient's tests.
Its default model is the Responses API, which vLLM P/D does not split: the recipe is
``OpenAIChatCompletionsModel(model=..., openai_client=AsyncPDChatClient(...))``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from pdclient import AsyncPDChatClient, Outcome, PDTrace

from .conftest import DECODE, MODEL, PREFILL, FakePair

pytest.importorskip("agents")

from agents import (
    Agent,
    ModelSettings,
    OpenAIChatCompletionsModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)

calls: list[str] = []


@function_tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    calls.append(city)
    return f"sunny in {city}"


@pytest.fixture(autouse=True)
def _no_agents_tracing() -> Iterator[None]:
    # The SDK's own tracing exports to OpenAI's servers by default: off in tests.
    set_tracing_disabled(True)
    calls.clear()
    yield


def weather_agent(traces: list[PDTrace], **settings: object) -> Agent:
    client = AsyncPDChatClient(
        prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="EMPTY", on_trace=traces.append
    )
    return Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(**settings),  # type: ignore[arg-type]
    )


async def test_agent_runs_a_function_tool(fake_pair: FakePair) -> None:
    """Turn 1: the model calls the tool; turn 2: it answers from the tool's result. Two P/D calls."""
    traces: list[PDTrace] = []
    result = await Runner.run(weather_agent(traces), "What is the weather in Paris?")
    assert calls == ["Paris"]
    assert result.final_output == fake_pair.answer
    fake_pair.assert_handoffs(2)
    tool_turn = fake_pair.decode_bodies[1]["messages"]
    assert tool_turn[-1] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny in Paris"}
    assert [t.forwarded_tokens > 0 for t in traces] == [True, True]
    assert len({t.request_id for t in traces}) == 2


async def test_agent_streamed_run(fake_pair: FakePair) -> None:
    traces: list[PDTrace] = []
    run = Runner.run_streamed(weather_agent(traces), "What is the weather in Paris?")
    kinds = [event.type async for event in run.stream_events()]
    assert "raw_response_event" in kinds
    assert calls == ["Paris"]
    assert run.final_output == fake_pair.answer
    fake_pair.assert_handoffs(2)
    assert all(body["stream"] is True for body in fake_pair.decode_bodies)


async def test_forced_tool_choice_stop_on_first_tool(fake_pair: FakePair) -> None:
    """The shape the e2e test uses with a model too small to choose tools: one forced call."""
    traces: list[PDTrace] = []
    agent = weather_agent(traces, tool_choice="get_weather").clone(tool_use_behavior="stop_on_first_tool")
    result = await Runner.run(agent, "What is the weather in Paris?")
    assert result.final_output == "sunny in Paris"
    fake_pair.assert_handoffs(1)
    assert fake_pair.prefill_bodies[0]["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}


async def test_agent_survives_prefill_outage(prefill_down: FakePair) -> None:
    traces: list[PDTrace] = []
    result = await Runner.run(weather_agent(traces), "What is the weather in Paris?")
    assert result.final_output == prefill_down.answer
    assert traces[0].fallback is not None and traces[0].fallback.startswith("prefill failed")
    # Later turns: the decode server computed the earlier ones, so they go decode-only or fall back.
    assert all(t.outcome is Outcome.DECODE_ONLY or (t.fallback or "").startswith("prefill failed") for t in traces)
