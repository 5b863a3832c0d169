"""The OpenAI Agents SDK on AsyncPDChatClient: an agent with a function tool.

Needs ``pip install openai-agents``. The SDK's default model speaks the Responses API;
for a vLLM P/D pair use its chat-completions model with the P/D client. vLLM serves tool
calls only when started with ``--enable-auto-tool-choice --tool-call-parser <parser>``;
the local pair this example starts has them. (SmolLM2-135M, the local model, seldom
decides to call a tool: a real model would call get_weather here.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from _pair import pd_pair
from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled

from pdclient import AsyncPDChatClient, PDTrace

TOOL_SERVER_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@function_tool
def get_weather(city: str) -> str:
    """Get the current weather for a city."""
    return f"sunny and 21 C in {city}"


async def run(prefill_urls: Sequence[str], decode_urls: Sequence[str], model: str) -> None:
    set_tracing_disabled(True)  # the SDK's own tracing would export to OpenAI's servers
    traces: list[PDTrace] = []
    client = AsyncPDChatClient(
        prefill_base_url=prefill_urls, decode_base_url=decode_urls, api_key="EMPTY", on_trace=traces.append
    )
    agent = Agent(
        name="weather",
        instructions="You answer questions about the weather. Be brief.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=ModelSettings(temperature=0, max_tokens=48),
    )
    result = await Runner.run(agent, "What is the weather like in Paris today?")
    print("agent:", result.final_output)
    print(f"{len(traces)} model call(s), each a P/D handoff forwarding {[t.forwarded_tokens for t in traces]} ids")


def main() -> None:
    with pd_pair(extra_server_args=TOOL_SERVER_ARGS) as pair:
        asyncio.run(run(pair.prefill_urls, pair.decode_urls, pair.model))


if __name__ == "__main__":
    main()
