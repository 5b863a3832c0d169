"""The Responses and Messages APIs through the handoff, on the real pair.

Each call is compared with the decode server's own answer to the same greedy request, and
each was a KV handoff (its trace, or the proxy's ``/metrics``). The prompt's ids go along
when the prefill server returns them (pdclient's server patch); a plain vLLM returns none,
and the trace's ``ids_skipped`` says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdclient import Outcome, PDOptions, PDTrace, PDTransport
from pdclient.dialects import endpoint_tag, untag_id
from pdclient.local import PDServers
from tests.serve.process import ServeProcess, metric_samples

from ._pair import Pair
from .helpers import agent_outcome

anthropic = pytest.importorskip("anthropic")

QUESTION = "Write one sentence about the sea."
MAX_TOKENS = 12


def handed_off(traces: list[PDTrace], calls: int, route: str) -> None:
    assert len(traces) == calls, traces
    for trace in traces:
        assert trace.route == route and trace.outcome is Outcome.DISAGGREGATED, trace
        assert trace.prefill_url is not None and trace.error is None, trace
        # Forwarded ids, or (a server without the patch) the reason none went along.
        assert trace.forwarded_tokens > 0 or (trace.ids_skipped and "server patch" in trace.ids_skipped), trace


@pytest.fixture(scope="module")
def pair(pd: PDServers) -> Pair:
    return Pair.of(pd)


# -- Responses -----------------------------------------------------------------------------------


def test_responses_create_and_stream_are_handoffs(pair: Pair, plain: openai.OpenAI) -> None:
    request = {"model": pair.model, "input": QUESTION, "temperature": 0, "max_output_tokens": MAX_TOKENS}
    reference = plain.responses.create(**request).output_text  # type: ignore[call-overload]
    traces: list[PDTrace] = []
    with pair.client(on_trace=traces.append) as client:
        answer = client.responses.create(**request)  # type: ignore[call-overload]
        streamed = client.responses.create(stream=True, **request)  # type: ignore[call-overload]
        deltas = [e.delta for e in streamed if e.type == "response.output_text.delta"]
    assert answer.output_text == reference
    assert "".join(deltas) == reference
    handed_off(traces, 2, "responses")
    # The id carries its decode endpoint's tag; the servers know it by their own id.
    own, tag = untag_id(answer.id)
    assert tag == endpoint_tag(traces[0].decode_url or "")
    # Both servers store responses (the session pair runs with the store on); the prefill
    # leg asked for nothing to be stored, so only the decode server knows the answer.
    assert httpx.get(f"{pair.decode_url}/responses/{own}", timeout=10).status_code == 200
    assert httpx.get(f"{pair.prefill_url}/responses/{own}", timeout=10).status_code == 404


def test_a_previous_response_id_follow_up_runs_where_the_response_is(pair: Pair, plain: openai.OpenAI) -> None:
    request = {"model": pair.model, "temperature": 0, "max_output_tokens": MAX_TOKENS}
    traces: list[PDTrace] = []
    with pair.client(on_trace=traces.append) as client:
        first = client.responses.create(input=QUESTION, **request)  # type: ignore[call-overload]
        follow_up = client.responses.create(previous_response_id=first.id, input="One more.", **request)  # type: ignore[call-overload]
    own, _ = untag_id(first.id)  # the decode server alone knows the response by its own id
    reference = plain.responses.create(previous_response_id=own, input="One more.", **request)  # type: ignore[call-overload]
    assert follow_up.output_text == reference.output_text
    handed_off(traces[:1], 1, "responses")
    trace = traces[1]
    assert trace.outcome is Outcome.DECODE_ONLY and trace.remote_prefill_reason == "stored_state", trace
    assert trace.decode_url == traces[0].decode_url and trace.decode_route == "conversation/stored_state", trace
    assert follow_up.previous_response_id == first.id


# -- Messages ------------------------------------------------------------------------------------


def _messages_reference(pd: PDServers) -> str:
    plain = anthropic.Anthropic(base_url=pd.decode_url.removesuffix("/v1"), api_key="-", max_retries=0)
    message = plain.messages.create(**_message_request(pd.model))
    return "".join(block.text for block in message.content if block.type == "text")


def _message_request(model: str) -> dict[str, object]:
    return {
        "model": model,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "messages": [{"role": "user", "content": QUESTION}],
    }


def _create_and_stream(client: object, model: str) -> tuple[str, str]:
    message = client.messages.create(**_message_request(model))  # type: ignore[attr-defined]
    created = "".join(block.text for block in message.content if block.type == "text")
    with client.messages.stream(**_message_request(model)) as stream:  # type: ignore[attr-defined]
        streamed = "".join(stream.text_stream)
    return created, streamed


def test_anthropic_sdk_in_process(pd: PDServers) -> None:
    reference = _messages_reference(pd)
    traces: list[PDTrace] = []
    options = PDOptions(prefill_base_url=pd.prefill_url, decode_base_url=pd.decode_url, on_trace=traces.append)
    with httpx.Client(transport=PDTransport(options=options)) as http:
        client = anthropic.Anthropic(base_url=pd.decode_url.removesuffix("/v1"), api_key="-", http_client=http)
        assert _create_and_stream(client, pd.model) == (reference, reference)
    handed_off(traces, 2, "messages")


@pytest.fixture(scope="module")
def serve(pd: PDServers) -> Iterator[ServeProcess]:
    process = ServeProcess("--prefill", pd.prefill_url, "--decode", pd.decode_url)
    try:
        yield process
    finally:
        process.stop()


def test_anthropic_sdk_through_pdclient_serve(pd: PDServers, serve: ServeProcess) -> None:
    reference = _messages_reference(pd)
    handoffs = ("pdclient_calls_total", (("outcome", "disaggregated"), ("route", "messages")))
    before = metric_samples(httpx.get(serve.url + "/metrics", timeout=10).text).get(handoffs, 0.0)
    client = anthropic.Anthropic(base_url=serve.url, api_key="-", max_retries=0)
    assert _create_and_stream(client, pd.model) == (reference, reference)
    after = metric_samples(httpx.get(serve.url + "/metrics", timeout=10).text).get(handoffs, 0.0)
    assert after - before == 2
    counted = client.messages.count_tokens(model=pd.model, messages=[{"role": "user", "content": QUESTION}])
    assert counted.input_tokens > 0  # passed through to the decode server


# -- frameworks on the Responses API -------------------------------------------------------------


async def test_agents_sdk_default_model_with_a_function_tool(pair: Pair) -> None:
    """The Agents SDK's default model (``OpenAIResponsesModel``) on ``AsyncPDChatClient``."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather for a city."""
        return f"sunny in {city}"

    settings = agents.ModelSettings(temperature=0, max_tokens=64)

    def agent(client: openai.AsyncOpenAI) -> object:
        model = agents.OpenAIResponsesModel(model=pair.model, openai_client=client)
        return agents.Agent(
            name="assistant", instructions="Answer briefly.", tools=[get_weather], model=model, model_settings=settings
        )

    plain = openai.AsyncOpenAI(base_url=pair.decode_url, api_key="EMPTY", max_retries=0)
    question = "What is the capital of France?"
    expected = await agent_outcome(agents, agent(plain), question)
    traces: list[PDTrace] = []
    client = pair.async_client(on_trace=traces.append, max_retries=0)
    assert await agent_outcome(agents, agent(client), question) == expected
    assert traces
    handed_off(traces, len(traces), "responses")


def test_langchain_chat_openai_on_the_responses_api(pair: Pair, plain: openai.OpenAI) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    traces: list[PDTrace] = []
    client = pair.client(on_trace=traces.append)
    options = {
        "model": pair.model,
        "api_key": "EMPTY",
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "use_responses_api": True,
    }
    pd = langchain_openai.ChatOpenAI(root_client=client, client=client.chat.completions, **options)
    reference = langchain_openai.ChatOpenAI(base_url=pair.decode_url, **options)

    def text(message: Any) -> str:
        found = message.text
        return str(found() if callable(found) else found)

    expected = text(reference.invoke(QUESTION))
    assert text(pd.invoke(QUESTION)) == expected
    assert "".join(text(chunk) for chunk in pd.stream(QUESTION)) == expected
    handed_off(traces, 2, "responses")
