"""``remote_prefill`` on the mocked pair: which calls skip the prefill, where they go, what is sent.

The fake prefill answers one id per character of the request's messages as JSON
(``ids_of_conversation``), so the client learns a chars-per-token ratio near 1 and a
2,000-character first turn is a ~2,000-token prompt: a short follow-up is mostly cached
on the decode endpoint that answered it (block size 128), and goes there decode-only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anyio
import httpx
import openai
import pytest

from pdclient import CallView, ConversationSettings, Outcome, PDConfigError, PDObserver, PDOptions, PDTrace
from pdclient.kv_events import chain_keys, pack
from tests.fake_vllm import DECODE, DECODE2, PREFILL, FakeVLLM, VLLMAnswers, echo, ids_of_conversation
from tests.polling import until
from tests.twins import Twin

SYSTEM = {"role": "system", "content": "You are a storyteller. " + "Once upon a time there was a tale. " * 60}
USER = {"role": "user", "content": "Tell me a story."}
FOLLOW_UP = {"role": "user", "content": "And then?"}
TURN1: list[dict[str, Any]] = [SYSTEM, USER]
ANSWER1 = echo({"messages": TURN1})
TURN2 = [*TURN1, {"role": "assistant", "content": ANSWER1}, FOLLOW_UP]


@pytest.fixture
def pair() -> Iterator[FakeVLLM]:
    """A prefill and two decode endpoints; ids one per character of the messages as JSON."""
    vllm = FakeVLLM(VLLMAnswers(ids=ids_of_conversation))
    with vllm.routes(PREFILL, DECODE, DECODE2):
        yield vllm


class Traces(PDObserver):
    def __init__(self) -> None:
        self.traces: list[PDTrace] = []

    def on_call_end(self, call: CallView, trace: PDTrace) -> None:
        self.traces.append(trace)


def twin(mode: str, **kwargs: Any) -> tuple[Twin, Traces]:
    traces = Traces()
    kwargs.setdefault("decode_base_url", [DECODE, DECODE2])
    kwargs.setdefault("routing", "round_robin")  # the second turn would go to DECODE2 if routed
    kwargs.setdefault("max_decode_migrations", 0)  # else the decode body asks for ids (return_token_ids)
    return Twin(mode, observers=[traces], **kwargs), traces


async def turn(t: Twin, messages: list[dict[str, Any]], stream: bool, **kwargs: Any) -> str:
    if stream:
        return "".join(await t.stream_text(messages=messages, **kwargs))
    completion = await t.chat(messages=messages, **kwargs)
    return str(completion.choices[0].message.content)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_auto_sends_a_follow_up_decode_only_to_the_decode_endpoint_of_the_previous_turn(
    mode: str, pair: FakeVLLM, stream: bool
) -> None:
    t, traces = twin(mode, remote_prefill="auto")
    assert await turn(t, TURN1, stream) == ANSWER1
    assert await turn(t, TURN2, stream) == echo({"messages": TURN2})
    # One prefill (the first turn's); the follow-up's decode went to the same endpoint.
    assert len(pair.prefill_bodies) == 1
    assert pair.decode_urls == [DECODE, DECODE]
    # The caller's body as the SDK sent it: no kv_transfer_params; a stream asks for its
    # usage (the prompt's length, what the server found cached), which the caller does not see.
    asked = {"stream": True, "stream_options": {"include_usage": True}}
    sent = {"messages": TURN2, "model": "m", **(asked if stream else {})}
    assert pair.decode_bodies[1] == sent
    first, second = traces.traces
    assert (first.outcome, first.remote_prefill, first.remote_prefill_reason, first.conversation) == (
        Outcome.DISAGGREGATED,
        True,
        "uncached_ratio_at_or_above",
        "unknown",
    )
    # The mocked servers answer at once: a streamed first turn times its handoff at a few ms,
    # quicker than the decode-only prior, so the follow-up goes decode-only as its trial.
    assert (second.outcome, second.remote_prefill, second.remote_prefill_reason, second.conversation) == (
        Outcome.DECODE_ONLY,
        False,
        "probe" if stream else "decode_only_faster",
        "extends_answer",
    )
    assert second.fallback is None and second.error is None and second.prefill_url is None
    assert second.decode_url == DECODE and second.decode_route == "conversation/held"
    assert second.estimated_uncached_tokens is not None and second.estimated_prompt_tokens is not None
    assert 0 < second.estimated_uncached_tokens < 256 < second.estimated_prompt_tokens
    await t.close()


async def test_a_stream_with_usage_turned_off_still_tells_the_next_turn_its_length(mode: str, pair: FakeVLLM) -> None:
    """vLLM's multi-turn benchmark streams with ``stream_options: {"include_usage": false}``.
    A decode-only turn asks its server for the usage all the same, and the caller sees none:
    the turn is remembered with its prompt's length, so the next turn is estimated from it,
    not from what the turn before it left cached."""
    t, traces = twin(mode, remote_prefill="auto")
    off = {"stream_options": {"include_usage": False, "continuous_usage_stats": True}}
    await turn(t, TURN1, True, **off)
    stream = await t.chat(messages=TURN2, stream=True, **off)
    chunks = list(stream) if mode == "sync" else [c async for c in stream]
    assert chunks and all(c.usage is None for c in chunks)  # as the caller asked
    answer2 = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert traces.traces[1].outcome is Outcome.DECODE_ONLY
    assert pair.decode_bodies[1]["stream_options"] == {"include_usage": True}
    turn3 = [*TURN2, {"role": "assistant", "content": answer2}, {"role": "user", "content": "And after that?"}]
    await turn(t, turn3, True, **off)
    second, third = traces.traces[1:]
    prompt2 = len(ids_of_conversation({"messages": TURN2}))
    assert second.cached_tokens is not None and third.cached_tokens is not None
    assert third.cached_tokens >= prompt2 // 128 * 128 > second.cached_tokens
    await t.close()


async def test_the_decision_travels_in_the_response_headers(pair: FakeVLLM) -> None:
    t, _ = twin("sync", remote_prefill="auto")
    await turn(t, TURN1, True)
    raw = t.client.chat.completions.with_raw_response.create(model="m", messages=TURN2)  # type: ignore[call-overload]
    trace = PDTrace.from_headers(raw.headers)
    assert raw.headers["x-pd-outcome"] == "decode_only"
    assert raw.headers["x-pd-remote-prefill"] == "false"
    assert (trace.remote_prefill, trace.remote_prefill_reason, trace.conversation) == (
        False,
        "probe",  # the instant mocked handoff beats the decode-only prior: a trial
        "extends_answer",
    )
    assert trace.estimated_uncached_tokens is not None


@pytest.mark.parametrize(
    "second",
    [
        [{**SYSTEM, "content": "You are terse."}, USER, {"role": "assistant", "content": ANSWER1}, FOLLOW_UP],
        [*TURN1, {"role": "assistant", "content": "an edited answer"}, {"role": "user", "content": "x" * 2000}],
        [{"role": "user", "content": "Something else entirely."}],
    ],
    ids=["edited-system-prompt", "long-new-message", "other-conversation"],
)
async def test_auto_hands_off_a_call_that_does_not_extend_the_conversation_cheaply(
    mode: str, pair: FakeVLLM, second: list[dict[str, Any]]
) -> None:
    t, traces = twin(mode, remote_prefill="auto")
    await turn(t, TURN1, True)
    await turn(t, second, True)
    assert len(pair.prefill_bodies) == 2
    assert all("kv_transfer_params" in body for body in pair.decode_bodies)
    assert traces.traces[1].outcome is Outcome.DISAGGREGATED
    assert traces.traces[1].remote_prefill is True
    await t.close()


async def test_a_made_up_history_the_client_never_answered_goes_through_the_prefill(mode: str, pair: FakeVLLM) -> None:
    """A first call whose history no one here answered (a long document, an assistant
    message no server wrote, a question) is not taken as cached on the decode endpoint its
    conversation is routed to: that server would prefill the document itself."""
    t, traces = twin(mode, routing="least_outstanding")  # the default: conversations by rendezvous
    document = {"role": "user", "content": "Read this document. " + "It goes on and on. " * 3000}
    made_up = [document, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "Its title?"}]
    await turn(t, made_up, True)
    (trace,) = traces.traces
    assert (trace.outcome, trace.remote_prefill, trace.conversation) == (
        Outcome.DISAGGREGATED,
        True,
        "unseen_history",
    )
    assert trace.estimated_uncached_tokens is not None and trace.estimated_uncached_tokens > 20_000
    assert len(pair.prefill_bodies) == 1
    # A conversation this client answered still goes decode-only.
    await turn(t, TURN1, True)
    await turn(t, TURN2, True)
    assert (traces.traces[-1].outcome, traces.traces[-1].conversation) == (Outcome.DECODE_ONLY, "extends_answer")
    await t.close()


async def test_a_tool_loop_goes_decode_only_after_its_first_turn(mode: str, pair: FakeVLLM) -> None:
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    t, traces = twin(mode, remote_prefill="auto")
    first = await t.chat(messages=TURN1, tools=tools)
    call = first.choices[0].message.tool_calls[0]
    result = {"role": "tool", "tool_call_id": call.id, "content": "sunny"}
    assistant = {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]}
    await t.chat(messages=[*TURN1, assistant, result], tools=tools)
    assert len(pair.prefill_bodies) == 1
    assert traces.traces[1].outcome is Outcome.DECODE_ONLY
    assert traces.traces[1].conversation == "extends_answer"
    await t.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_decode_only_call_sends_its_prompt_to_the_prefill_server_as_a_plain_one_token_call(
    mode: str, pair: FakeVLLM, stream: bool
) -> None:
    t, traces = twin(mode, remote_prefill="auto")
    await turn(t, TURN1, stream)
    await turn(t, TURN2, stream, temperature=0.5)
    await until(lambda: len(pair.warm_up_bodies) == 1)
    (warm_up,) = pair.warm_up_bodies
    # The prompt as the caller sent it, one token, not streamed, and nothing held for a decode.
    assert warm_up == {"messages": TURN2, "model": "m", "temperature": 0.5, "stream": False, "max_tokens": 1, "n": 1}
    request = pair.router.routes["prefill"].calls.last.request
    assert request.headers["authorization"] == "Bearer sk-test"
    assert request.headers["x-request-id"].endswith("-warm-up")
    first, second = traces.traces
    assert first.prefill_warm_up_url is None
    assert (second.outcome, second.prefill_url, second.prefill_warm_up_url) == (Outcome.DECODE_ONLY, None, PREFILL)
    assert len(pair.prefill_bodies) == 1 and pair.decode_urls == [DECODE, DECODE]
    await t.close()


@pytest.mark.parametrize(
    "settings", [{"remote_prefill": "never"}, {"remote_prefill": "auto", "conversations": "off"}], ids=["never", "off"]
)
async def test_no_warm_up_with_never_or_when_turned_off(mode: str, pair: FakeVLLM, settings: dict[str, Any]) -> None:
    settings = dict(settings)
    if settings.pop("conversations", None) == "off":
        settings["conversations"] = ConversationSettings(warm_prefill=False)
    t, traces = twin(mode, **settings)
    await turn(t, TURN1, True)
    await turn(t, TURN2, True)
    assert traces.traces[1].outcome is Outcome.DECODE_ONLY and traces.traces[1].prefill_warm_up_url is None
    await anyio.sleep(0.2)
    assert pair.warm_up_bodies == []
    await t.close()


async def test_a_failing_warm_up_changes_nothing_for_the_caller(mode: str, pair: FakeVLLM) -> None:
    t, _ = twin(mode, remote_prefill="auto")
    await turn(t, TURN1, True)
    pair.router.routes["prefill"].side_effect = httpx.ConnectError("refused")
    assert await turn(t, TURN2, True) == echo({"messages": TURN2})
    await until(lambda: t.client.pd_fleet.warmer.failed == 1)
    # The warm-up is the client's own business: the prefill endpoint's breaker is not told.
    assert all(e.admits() for e in t.client.pd_fleet.prefill.endpoints)
    await t.close()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_never_sends_every_call_decode_only_to_the_routed_endpoint(
    mode: str, pair: FakeVLLM, stream: bool
) -> None:
    t, traces = twin(mode, remote_prefill="never")
    assert await turn(t, TURN1, stream) == ANSWER1
    completion = await t.call(t.client.completions.create, model="m", prompt="Once")
    assert completion.choices[0].text == "echo:Once"
    assert pair.prefill_bodies == []
    assert pair.decode_urls == [DECODE, DECODE2]  # routed as usual (round robin)
    assert all("kv_transfer_params" not in body for body in pair.decode_bodies)
    assert [(tr.outcome, tr.remote_prefill_reason, tr.fallback) for tr in traces.traces] == [
        (Outcome.DECODE_ONLY, "mode_never", None),
        (Outcome.DECODE_ONLY, "mode_never", None),
    ]
    await t.close()


async def test_auto_hands_off_completions_calls(mode: str, pair: FakeVLLM) -> None:
    t, traces = twin(mode, remote_prefill="auto")
    await t.call(t.client.completions.create, model="m", prompt="Once")
    await t.call(t.client.completions.create, model="m", prompt="Once upon")
    assert len(pair.prefill_bodies) == 2
    assert [tr.remote_prefill_reason for tr in traces.traces] == ["no_estimate", "no_estimate"]
    await t.close()


async def test_auto_is_the_default(mode: str, pair: FakeVLLM) -> None:
    t, traces = twin(mode)
    assert t.client.pd_options.remote_prefill == "auto"
    await turn(t, TURN1, True)
    await turn(t, TURN2, True)
    assert [tr.outcome for tr in traces.traces] == [Outcome.DISAGGREGATED, Outcome.DECODE_ONLY]
    await t.close()


async def test_always_remembers_nothing(mode: str, pair: FakeVLLM) -> None:
    t, traces = twin(mode, remote_prefill="always")
    await turn(t, TURN1, True)
    await turn(t, TURN2, True)
    assert len(pair.prefill_bodies) == 2
    assert [tr.remote_prefill_reason for tr in traces.traces] == ["mode_always", "mode_always"]
    assert len(t.client.pd_fleet.memory) == 0
    await t.close()


async def test_a_call_overrides_the_clients_mode(mode: str, pair: FakeVLLM) -> None:
    t, traces = twin(mode, remote_prefill="auto")
    await turn(t, TURN1, True)
    await turn(t, TURN2, True, extra_body={"pdclient": {"remote_prefill": "always"}})
    await turn(t, TURN1, True, extra_body={"pdclient": {"remote_prefill": "never"}})
    assert len(pair.prefill_bodies) == 2
    assert [tr.outcome for tr in traces.traces] == [Outcome.DISAGGREGATED, Outcome.DISAGGREGATED, Outcome.DECODE_ONLY]
    assert all("pdclient" not in body for body in pair.decode_bodies)
    await t.close()


async def test_a_misspelt_mode_is_a_400_naming_it(mode: str, pair: FakeVLLM) -> None:
    t, _ = twin(mode)
    with pytest.raises(openai.BadRequestError, match=r"pdclient\.remote_prefill must be one of"):
        await turn(t, TURN1, True, extra_body={"pdclient": {"remote_prefill": "sometimes"}})
    assert pair.prefill_bodies == [] and pair.decode_bodies == []
    await t.close()


def test_options_are_checked() -> None:
    with pytest.raises(PDConfigError, match="remote_prefill must be one of always, never, auto"):
        PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODE, remote_prefill="sometimes")
    with pytest.raises(PDConfigError, match="conversations must be a ConversationSettings"):
        PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODE, conversations={"threshold_tokens": 1})  # type: ignore[arg-type]
    with pytest.raises(PDConfigError, match=r"conversations\.max_uncached_ratio"):
        ConversationSettings(max_uncached_ratio=2.0)


async def test_a_conversation_whose_decode_endpoint_is_not_admitted_is_handed_off(mode: str, pair: FakeVLLM) -> None:
    t, traces = twin(mode, remote_prefill="auto")
    await turn(t, TURN1, True)
    holder = next(e for e in t.client.pd_fleet.decode.endpoints if e.url == DECODE)
    holder.trip()  # its breaker opens: the conversation counts as uncached
    await turn(t, TURN2, True)
    assert len(pair.prefill_bodies) == 2
    assert pair.decode_urls == [DECODE, DECODE2]
    assert (traces.traces[1].outcome, traces.traces[1].conversation) == (
        Outcome.DISAGGREGATED,
        "endpoint_unavailable",
    )
    await t.close()


async def test_copies_share_the_memory(mode: str, pair: FakeVLLM) -> None:
    t, traces = twin(mode, remote_prefill="auto")
    await turn(t, TURN1, True)
    copy = t.client.with_options(timeout=30)
    await t.chat(copy, messages=TURN2)
    assert len(pair.prefill_bodies) == 1
    assert traces.traces[1].outcome is Outcome.DECODE_ONLY
    await t.close()


async def test_a_broken_answer_is_not_remembered(mode: str, pair: FakeVLLM) -> None:
    t, traces = twin(mode, remote_prefill="auto")
    pair.cuts.append(2)  # the first turn's stream breaks after its role chunk
    with pytest.raises(openai.APIConnectionError):
        await turn(t, TURN1, True)
    await turn(t, TURN2, True)
    assert len(pair.prefill_bodies) == 2
    assert (traces.traces[1].outcome, traces.traces[1].conversation) == (Outcome.DISAGGREGATED, "unknown")
    await t.close()


class Frames(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body sent one SSE event at a time, as a server streams it."""

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames

    def __iter__(self) -> Iterator[bytes]:
        yield from self.frames

    async def __aiter__(self) -> Any:
        for frame in self.frames:
            yield frame


async def test_an_abandoned_answer_is_not_remembered(mode: str, pair: FakeVLLM) -> None:
    t, traces = twin(mode, remote_prefill="auto")

    def framed(request: httpx.Request) -> httpx.Response:
        whole = pair.respond(request)
        frames = [event + b"\n\n" for event in whole.content.split(b"\n\n") if event]
        return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=Frames(frames))

    pair.router.routes["decode"].side_effect = framed
    stream = await t.chat(messages=TURN1, stream=True)
    if mode == "sync":
        next(iter(stream))
        stream.close()
    else:
        await stream.__anext__()
        await stream.close()
    await turn(t, TURN2, True)
    assert len(pair.prefill_bodies) == 2
    assert traces.traces[1].conversation == "unknown"
    # The second call's answer only: one cut short says nothing of its time.
    assert answer_times(t, DECODE) + answer_times(t, DECODE2) == 1
    await t.close()


def answer_times(t: Twin, endpoint: str) -> int:
    """The whole answers the cost model timed on ``endpoint`` (what the stall budget is a share of)."""
    learnt = t.client.pd_fleet.costs._decode.get(endpoint)
    return len(learnt.answers) if learnt is not None else 0


async def test_whole_streamed_answers_teach_the_decode_endpoints_answer_time(mode: str, pair: FakeVLLM) -> None:
    t, traces = twin(mode, remote_prefill="auto", decode_base_url=[DECODE])
    costs = t.client.pd_fleet.costs
    await turn(t, TURN1, False)  # not streamed: its first byte is its last, no answer time
    assert answer_times(t, DECODE) == 0
    for messages in (TURN1, TURN2, TURN1, TURN2):  # handoffs and decode-only turns alike
        await turn(t, messages, True)
    assert {trace.outcome for trace in traces.traces[1:]} == {Outcome.DISAGGREGATED, Outcome.DECODE_ONLY}
    assert answer_times(t, DECODE) == 4
    (learnt,) = [line for name, endpoint, line in costs.lines() if name == "answer" and endpoint == DECODE]
    assert learnt.samples == 4 and learnt.fixed_ms == costs.answer_ms(DECODE) < 1500.0  # no longer the prior's
    await t.close()


async def test_a_decode_only_call_whose_endpoint_fails_to_connect_is_handed_off_to_another(
    mode: str, pair: FakeVLLM
) -> None:
    """Another decode endpoint holds nothing of the conversation: sent there decode-only, it
    would compute the whole conversation itself. The call becomes a P/D handoff instead."""
    t, traces = twin(mode, remote_prefill="auto")
    await turn(t, TURN1, True)
    pair.router.routes["decode"].side_effect = [httpx.ConnectError("refused")]
    assert await turn(t, TURN2, True) == echo({"messages": TURN2})
    assert pair.decode_urls == [DECODE, DECODE2]
    assert len(pair.prefill_bodies) == 2
    ids = pair.decode_bodies[1]["kv_transfer_params"]["prompt_token_ids"]
    assert ids == ids_of_conversation({"messages": TURN2})
    second = traces.traces[1]
    assert (second.outcome, second.remote_prefill, second.conversation) == (
        Outcome.DISAGGREGATED,
        True,
        "endpoint_unavailable",
    )
    assert second.remote_prefill_reason == "uncached_ratio_at_or_above"
    assert second.error is None and second.decode_url == DECODE2
    assert [e.in_flight for e in t.client.pd_fleet.decode.endpoints] == [0, 0]
    await t.close()


async def test_a_decode_only_call_whose_endpoint_stops_admitting_is_handed_off(mode: str, pair: FakeVLLM) -> None:
    """Its breaker opened between the estimate and the decode leg: the same, without an attempt there."""
    t, traces = twin(mode, remote_prefill="auto", conversations=ConversationSettings(warm_prefill=False))
    await turn(t, TURN1, True)
    holder = next(e for e in t.client.pd_fleet.decode.endpoints if e.url == DECODE)
    real_estimate = t.client.pd_fleet.memory.estimate

    def estimate_then_trip(*args: Any, **kwargs: Any) -> Any:
        estimate = real_estimate(*args, **kwargs)
        holder.trip()
        return estimate

    t.client.pd_fleet.memory.estimate = estimate_then_trip  # type: ignore[method-assign]
    assert await turn(t, TURN2, False) == echo({"messages": TURN2})
    assert pair.decode_urls == [DECODE, DECODE2] and len(pair.prefill_bodies) == 2
    assert "kv_transfer_params" in pair.decode_bodies[1]
    assert (traces.traces[1].outcome, traces.traces[1].conversation) == (Outcome.DISAGGREGATED, "endpoint_unavailable")
    await t.close()


def test_metrics_count_decode_only_calls_apart_from_prefill_failures(pair: FakeVLLM) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from pdclient.metrics import PrometheusObserver

    registry = prometheus_client.CollectorRegistry()
    t = Twin(
        "sync",
        decode_base_url=[DECODE, DECODE2],
        remote_prefill="auto",
        conversations=ConversationSettings(warm_prefill=False),  # the prefill route's answers are counted
        max_decode_migrations=0,
        observers=[PrometheusObserver(registry)],
    )
    client: Any = t.client
    for messages in (TURN1, TURN2):
        "".join(
            c.choices[0].delta.content or ""
            for c in client.chat.completions.create(model="m", messages=messages, stream=True)
        )
    pair.router.routes["prefill"].side_effect = [httpx.Response(500)] * 3
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "new"}])

    def calls(outcome: str) -> float | None:
        return registry.get_sample_value("pdclient_calls_total", {"route": "chat", "outcome": outcome})

    assert (calls("disaggregated"), calls("decode_only"), calls("prefill_failed")) == (1.0, 1.0, 1.0)
    decisions = {"route": "chat", "remote_prefill": "false", "reason": "probe"}  # instant mocks: a trial
    assert registry.get_sample_value("pdclient_remote_prefill_decisions_total", decisions) == 1.0


def test_the_prefill_body_is_unchanged_by_auto(pair: FakeVLLM) -> None:
    t, _ = twin("sync", remote_prefill="auto")
    t.client.chat.completions.create(model="m", messages=TURN1)  # type: ignore[call-overload]
    assert json.loads(json.dumps(pair.prefill_bodies[0]))["messages"] == TURN1
    assert pair.decode_bodies[0]["kv_transfer_params"]["prompt_token_ids"] == ids_of_conversation({"messages": TURN1})


def ids_the_decode_sent(vllm: FakeVLLM, body: dict[str, Any]) -> tuple[list[int], list[int]]:
    """The prompt's and the answer's ids the fake decode streams for ``body`` (``return_token_ids``)."""
    events = vllm.answers.decode_events("/v1/chat/completions", {**body, "stream": True, "return_token_ids": True})
    answer = [i for event in events for choice in event["choices"] for i in choice.get("token_ids", ())]
    return events[0]["prompt_token_ids"], answer


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_with_kv_events_a_turn_keeps_the_keys_of_its_prompt_and_answer_ids(
    mode: str, pair: FakeVLLM, stream: bool
) -> None:
    # A publisher nobody runs: the view stays unknown, so the estimator decides, as here.
    t, traces = twin(mode, remote_prefill="auto", kv_events="tcp://{host}:9")
    memory = t.client.pd_fleet.memory
    assert await turn(t, TURN1, stream) == ANSWER1
    prefill_ids, answer_ids = ids_the_decode_sent(pair, pair.decode_bodies[0])
    assert prefill_ids == pair.decode_bodies[0]["kv_transfer_params"]["prompt_token_ids"]
    (first,) = memory._turns.values()
    assert first.turn().answer_keyed
    assert first.turn().prompt_keys == pack(chain_keys(prefill_ids + answer_ids[:-1], 128))

    assert await turn(t, TURN2, stream) == echo({"messages": TURN2})
    assert traces.traces[1].outcome is Outcome.DECODE_ONLY
    # The decode-only leg asked for the ids too: its prompt's come from the decode itself.
    assert all(body.get("return_token_ids") is True for body in pair.decode_bodies)
    prompt_ids, answer_ids = ids_the_decode_sent(pair, pair.decode_bodies[1])
    (second,) = memory._turns.values()
    assert second.turn().answer_keyed
    assert second.turn().prompt_keys == pack(chain_keys(prompt_ids + answer_ids[:-1], 128))
    await t.close()


async def test_the_ids_asked_for_never_reach_the_caller(pair: FakeVLLM) -> None:
    t, _ = twin("sync", remote_prefill="auto", kv_events="tcp://{host}:9")
    await turn(t, TURN1, True)
    for stream in (True, False):
        raw = t.client.chat.completions.with_raw_response.create(model="m", messages=TURN2, stream=stream)  # type: ignore[call-overload]
        assert b'token_ids":[' not in raw.http_response.read()
    await t.close()


# -- a history no one here saw, counted by the decode's KV events -------------------------

FEW_SHOT: list[dict[str, Any]] = [
    SYSTEM,
    {"role": "user", "content": "Tell me a story."},
    {"role": "assistant", "content": "Once, a robot painted the dawn."},
    {"role": "user", "content": "Another one, please."},
]
PROMPT_IDS = list(range(1000, 2000))  # what the prefill's /tokenize answers for FEW_SHOT


def decode_holding(blocks: int | None) -> Any:
    """The decode's events as ``KVEventFeeds.held_tokens`` reads them: the first ``blocks``
    of PROMPT_IDS held (None: its view is not current)."""
    keys = chain_keys(PROMPT_IDS, 128)

    def held(endpoint: str, chain: Any, block: int) -> int | None:
        if blocks is None:
            return None
        count = 0
        for key in list(chain)[:blocks]:
            if key != keys[count]:
                break
            count += 1
        return count * block

    return held


def fresh(mode: str) -> tuple[Twin, Traces]:
    """A client that never saw a turn, its decode routed by the default policy (the
    conversation's rendezvous home), reading KV events."""
    return twin(
        mode, remote_prefill="auto", kv_events="tcp://{host}:9", decode_base_url=DECODE, routing="least_outstanding"
    )


@pytest.mark.parametrize(
    ("blocks", "outcome", "cached"),
    [(0, Outcome.DISAGGREGATED, 0), (7, Outcome.DECODE_ONLY, 896)],
    ids=["not-held", "held"],
)
async def test_a_history_never_seen_here_is_decode_only_only_when_the_decode_holds_it(
    mode: str, pair: FakeVLLM, blocks: int, outcome: Outcome, cached: int
) -> None:
    """A fresh client, a few-shot history it never saw answered: the prefill server's
    /tokenize gives the prompt's ids, and the decode's events say how much of them it holds."""
    t, traces = fresh(mode)
    t.client.pd_fleet.kv_events.held_tokens = decode_holding(blocks)  # type: ignore[method-assign, union-attr]
    tokenize = pair.router.post(PREFILL.removesuffix("/v1") + "/tokenize", name="tokenize").mock(
        return_value=httpx.Response(200, json={"count": len(PROMPT_IDS), "tokens": PROMPT_IDS, "max_model_len": 8192})
    )
    await turn(t, FEW_SHOT, True, max_tokens=4)
    trace = traces.traces[-1]
    assert (trace.outcome, trace.cache_source, trace.cached_tokens) == (outcome, "kv_events", cached)
    assert trace.estimated_prompt_tokens == len(PROMPT_IDS)
    assert trace.tokenize_ms is not None and trace.tokenize_ms >= 0
    assert tokenize.call_count == 1
    sent = json.loads(tokenize.calls[0].request.content)
    assert sent == {"model": "m", "messages": FEW_SHOT}  # rendered as the chat call is, nothing else
    await t.close()


@pytest.mark.parametrize("answer", ["unknown-view", "error", "not-ids"])
async def test_without_the_decodes_view_or_the_ids_the_estimate_decides(mode: str, pair: FakeVLLM, answer: str) -> None:
    t, traces = fresh(mode)
    t.client.pd_fleet.kv_events.held_tokens = decode_holding(None if answer == "unknown-view" else 0)  # type: ignore[method-assign, union-attr]
    reply = {
        "unknown-view": httpx.Response(200, json={"tokens": PROMPT_IDS}),
        "error": httpx.Response(404, json={"detail": "Not Found"}),
        "not-ids": httpx.Response(200, json={"tokens": ["a"]}),
    }[answer]
    tokenize = pair.router.post(PREFILL.removesuffix("/v1") + "/tokenize", name="tokenize").mock(return_value=reply)
    await turn(t, FEW_SHOT, True, max_tokens=4)
    trace = traces.traces[-1]
    assert trace.cache_source == "estimate" and trace.outcome is not None
    assert tokenize.call_count == (0 if answer == "unknown-view" else 1)
    assert (trace.tokenize_ms is None) == (answer == "unknown-view")
    await t.close()


def tokenized(pair: FakeVLLM, reply: httpx.Response | Exception | None = None) -> Any:
    """The prefill's /tokenize route, answering PROMPT_IDS (or ``reply``)."""
    answer = httpx.Response(200, json={"count": len(PROMPT_IDS), "tokens": PROMPT_IDS, "max_model_len": 8192})
    route = pair.router.post(PREFILL.removesuffix("/v1") + "/tokenize", name="tokenize")
    if isinstance(reply, Exception):
        return route.mock(side_effect=reply)
    return route.mock(return_value=reply or answer)


async def test_a_decode_only_call_after_a_tokenize_sends_its_ids_as_a_handoff_does(mode: str, pair: FakeVLLM) -> None:
    """The ids /tokenize gave for a history the decode holds go on the decode-only leg, in
    the channel a handoff's prefill ids take (``kv_transfer_params.prompt_token_ids``): the
    decode server takes them in place of rendering and tokenizing the messages again."""
    t, traces = fresh(mode)
    t.client.pd_fleet.kv_events.held_tokens = decode_holding(7)  # type: ignore[method-assign, union-attr]
    tokenized(pair)
    await turn(t, FEW_SHOT, True, max_tokens=4)
    trace = traces.traces[-1]
    assert trace.outcome is Outcome.DECODE_ONLY
    (body,) = pair.decode_bodies
    assert body["kv_transfer_params"] == {"prompt_token_ids": PROMPT_IDS}
    assert body["messages"] == FEW_SHOT  # the caller's fields as sent
    assert trace.forwarded_tokens == len(PROMPT_IDS) and trace.ids_skipped is None
    await t.close()


async def test_a_handoff_after_a_tokenize_forwards_the_prefills_ids(mode: str, pair: FakeVLLM) -> None:
    t, traces = fresh(mode)
    t.client.pd_fleet.kv_events.held_tokens = decode_holding(0)  # type: ignore[method-assign, union-attr]
    tokenized(pair)
    await turn(t, FEW_SHOT, True, max_tokens=4)
    assert traces.traces[-1].outcome is Outcome.DISAGGREGATED
    (body,) = pair.decode_bodies
    assert body["kv_transfer_params"]["prompt_token_ids"] == ids_of_conversation({"messages": FEW_SHOT})
    await t.close()


async def test_a_signed_decode_only_leg_with_ids_is_signed_as_a_handoffs(mode: str, pair: FakeVLLM) -> None:
    from tests.mocked.test_signing import verified

    t, traces = twin(
        mode,
        remote_prefill="auto",
        kv_events="tcp://{host}:9",
        decode_base_url=DECODE,
        routing="least_outstanding",
        reuse_secret="s3cret",
    )
    t.client.pd_fleet.kv_events.held_tokens = decode_holding(7)  # type: ignore[method-assign, union-attr]
    tokenized(pair)
    await turn(t, FEW_SHOT, True, max_tokens=4)
    assert traces.traces[-1].outcome is Outcome.DECODE_ONLY
    request = pair.router.routes["decode"].calls[-1].request
    assert json.loads(request.content)["kv_transfer_params"] == {"prompt_token_ids": PROMPT_IDS}
    assert verified(request, "s3cret")
    await t.close()


@pytest.mark.parametrize(
    "reply",
    [
        httpx.Response(404, json={"detail": "Not Found"}),
        httpx.Response(200, json={"tokens": ["a"]}),
        httpx.Response(200, json={"count": 3, "tokens": PROMPT_IDS}),
        httpx.ReadTimeout("the prefill is busy"),
        httpx.ConnectError("no route"),
    ],
    ids=["refused", "not-ids", "miscounted", "timeout", "unreachable"],
)
async def test_a_decode_only_call_without_the_ids_sends_its_messages_alone(
    mode: str, pair: FakeVLLM, reply: httpx.Response | Exception
) -> None:
    """A /tokenize that failed in any way leaves the decode-only leg as it was: the messages,
    no ``kv_transfer_params``; the decode server renders them itself."""
    t, traces = fresh(mode)
    t.client.pd_fleet.kv_events.held_tokens = decode_holding(7)  # type: ignore[method-assign, union-attr]
    route = tokenized(pair, reply)
    # The history is short and the estimate trusts it: decode-only on the call's word.
    await turn(t, FEW_SHOT, True, max_tokens=4)
    trace = traces.traces[-1]
    assert route.call_count == 1 and trace.cache_source == "estimate"
    assert trace.outcome is Outcome.DECODE_ONLY
    (body,) = pair.decode_bodies
    assert "kv_transfer_params" not in body
    assert trace.forwarded_tokens == 0
    await t.close()


@pytest.mark.parametrize(
    "extra",
    [
        {"reasoning_effort": "low"},
        {"documents": [{"title": "t", "text": "x"}]},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required"},
        {"response_format": {"type": "json_object"}},
        {"truncate_prompt_tokens": 512},
        {"extra_body": {"pdclient": {"forward_ids": False}}},
    ],
    ids=["reasoning_effort", "documents", "tool_choice", "response_format", "truncate", "forward_ids-off"],
)
async def test_ids_a_tokenize_may_not_render_as_the_chat_call_does_are_not_forwarded(
    mode: str, pair: FakeVLLM, extra: dict[str, Any]
) -> None:
    """/tokenize renders messages, tools and the template's options, not the chat fields some
    templates read besides (``reasoning_effort``, ``documents``, a forced ``tool_choice``,
    ``response_format``) nor chat's truncation: with any of them the ids might not be the
    decode's, so its leg goes as before; as it does when the caller turned ids off."""
    t, traces = fresh(mode)
    t.client.pd_fleet.kv_events.held_tokens = decode_holding(7)  # type: ignore[method-assign, union-attr]
    tokenized(pair)
    body_extra = extra.get("extra_body", {})
    fields = {k: v for k, v in extra.items() if k != "extra_body"}
    await turn(t, FEW_SHOT, True, max_tokens=4, extra_body={**fields, **body_extra})
    trace = traces.traces[-1]
    assert trace.outcome is Outcome.DECODE_ONLY and trace.cache_source == "kv_events"
    (body,) = pair.decode_bodies
    assert "kv_transfer_params" not in body
    assert trace.forwarded_tokens == 0
    await t.close()


async def test_cache_aware_prefill_routing_follows_the_prefill_servers_events(mode: str, pair: FakeVLLM) -> None:
    """A handoff of a remembered conversation goes to the prefill endpoint whose KV events
    hold most of its known ids, whatever this process last sent where."""
    second_prefill = "http://prefill-2.test:8100/v1"
    pair.router.post(f"{second_prefill}/chat/completions", name="prefill2").mock(
        side_effect=lambda request: pair.respond(request, at_prefill=True)
    )
    t, traces = twin(
        mode,
        remote_prefill="auto",
        kv_events="tcp://{host}:9",
        prefill_base_url=[PREFILL, second_prefill],
        decode_base_url=DECODE,
        prefill_routing="cache_aware",
        routing="least_outstanding",
    )
    assert await turn(t, TURN1, True) == ANSWER1
    first_prefill = traces.traces[-1].prefill_url
    holder = second_prefill if first_prefill == PREFILL else PREFILL

    def held(endpoint: str, keys: Any, block: int) -> int | None:
        # The decode holds nothing (the follow-up is a handoff); only the other prefill holds the keys.
        return len(list(keys)) * block if endpoint == holder else 0

    t.client.pd_fleet.kv_events.held_tokens = held  # type: ignore[method-assign, union-attr]
    await turn(t, TURN2, True)
    trace = traces.traces[-1]
    assert (trace.outcome, trace.cache_source, trace.prefill_url) == (Outcome.DISAGGREGATED, "kv_events", holder)
    assert trace.prefill_route is not None and trace.prefill_route.startswith("cache_aware/events held=")
    await t.close()
