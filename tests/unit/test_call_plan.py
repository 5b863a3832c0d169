"""A call's planning without HTTP: whether it gets a prefill, where its decode goes, how its
legs go out, what each leg's body is per API, and how the caller's usage is made.

The call is driven by hand, as the transports drive it; the servers' answers are played
by the test (nothing is sent). The pure parts (``decide``, ``handoff_after_all``,
``usage_merge_for``, ``asks_usage``, ``id_tags_for``) are checked on their own inputs.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pdclient import Outcome, PDOptions
from pdclient._observe import Observers
from pdclient.conversations import Answer, ConversationSettings, Decision, Estimate, Match, Reason
from pdclient.fleet import Fleet
from pdclient.handoff import (
    RELEASE_TIMEOUT,
    Call,
    CallContext,
    ConversationTurn,
    LegRequests,
    asks_usage,
    dispatch,
    handoff_after_all,
    id_tags_for,
    release_leg,
    release_request,
    remote_prefill_decision,
    usage_merge_for,
)
from pdclient.handoff._flow import sequential_again
from pdclient.routing import RouteDecision
from pdclient.wire import SIGNATURE_HEADER
from tests.fake_vllm import NIXL_PARAMS, prefill_json

PREFILL = "http://p:8100/v1"
DECODES = ["http://d1:8200/v1", "http://d2:8200/v1"]
SETTINGS = ConversationSettings()
PUSH = {**NIXL_PARAMS, "tp_size": 1, "transfer_mode": "push"}


def make_call(
    body: dict[str, Any], path: str = "/chat/completions", fleet: Fleet | None = None, **options: Any
) -> Call:
    opts = PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODES, **options)
    fleet = fleet if fleet is not None and fleet.serves(opts) else Fleet(opts, asynchronous=False)
    context = CallContext(options=opts, fleet=fleet, observers=Observers([]))
    request = httpx.Request("POST", f"{DECODES[0]}{path}", json=body, headers={"connection": "keep-alive"})
    call = Call(context, request)
    assert call.plan_or_refuse() is None
    return call


def chat(*turns: str, stream: bool = True, **fields: Any) -> dict[str, Any]:
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(turns)]
    return {"model": "m", "messages": messages, "stream": stream, "max_tokens": 8, **fields}


def sent(request: httpx.Request) -> dict[str, Any]:
    body: dict[str, Any] = json.loads(request.content)
    return body


def prefilled(call: Call, answer: dict[str, Any] | None = None) -> httpx.Request:
    """Run the call's prefill with ``answer`` (a chat prefill's by default), then build its decode."""
    request = call.prefill_request()
    assert call.check_prefill(httpx.Response(200, json=answer or prefill_json(sent(request)))) is None
    return call.decode_request()


# -- the decision --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("mode", "prefills", "reason"), [("always", True, "mode_always"), ("never", False, "mode_never")]
)
def test_always_and_never_decide_without_an_estimate(mode: str, prefills: bool, reason: str) -> None:
    call = make_call(chat("hi"), remote_prefill=mode)
    assert call.wants_prefill() is prefills
    assert (
        call.remote.decision is not None
        and call.remote.decision.reason.value == reason
        and call.remote.decision.estimate is None
    )
    assert call.record.outcome is (Outcome.DISAGGREGATED if prefills else Outcome.DECODE_ONLY)
    # Only a call whose turn may be remembered keeps its conversation (never: yes; always: no).
    assert (call.remote.conversation is None) is (mode == "always")


def test_auto_on_an_unknown_conversation_gets_its_prefill() -> None:
    call = make_call(chat("a long first question " * 200), remote_prefill="auto")
    assert call.wants_prefill()
    assert call.remote.decision is not None and call.remote.decision.remote_prefill
    assert call.remote.decision.estimate is not None and call.remote.decision.estimate.match is Match.UNKNOWN


def test_auto_on_completions_has_no_estimate_and_gets_its_prefill() -> None:
    call = make_call({"model": "m", "prompt": "hi", "max_tokens": 4}, "/completions", remote_prefill="auto")
    assert call.wants_prefill() and call.remote.conversation is None
    assert call.remote.decision == Decision(True, Reason.NO_ESTIMATE, None, None)


def remembered(fleet: Fleet, body: dict[str, Any], endpoint: str) -> None:
    """The memory holds ``body``'s turn, answered by ``endpoint``."""
    first = make_call(body, fleet=fleet, remote_prefill="auto")
    assert first.plan is not None
    turn = ConversationTurn(first.plan, fleet.memory)
    fleet.memory.remember(first.plan.affinity_key, turn.body(), Answer("fine", (), 3), endpoint, prompt_tokens=600)


def follow_up_of_a_remembered_turn() -> Call:
    """The next turn of a conversation whose first turn the memory holds on the second decode endpoint."""
    options = PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODES, remote_prefill="auto")
    fleet = Fleet(options, asynchronous=False)
    question = "a long first question " * 200
    remembered(fleet, chat(question), DECODES[1])
    call = make_call(chat(question, "fine", "and?"), fleet=fleet, remote_prefill="auto")
    assert not call.wants_prefill()
    return call


def test_auto_sends_a_cached_conversation_decode_only_to_the_endpoint_holding_it() -> None:
    call = follow_up_of_a_remembered_turn()
    assert call.record.outcome is Outcome.DECODE_ONLY and call.remote.decision is not None
    assert (call.remote.decision.reason, call.remote.decision.decode_endpoint) == (
        Reason.DECODE_ONLY_FASTER,
        DECODES[1],
    )
    decode = call.decode_request()
    # Decode-only: the caller's fields as sent, on the endpoint holding the conversation,
    # asking for the usage the memory learns from (the caller did not ask for it).
    assert decode.url.host == "d2" and call.decode.decision is not None and call.decode.decision.rule == "held"
    body = sent(decode)
    assert "kv_transfer_params" not in body and body["stream_options"] == {"include_usage": True}


def test_a_held_conversation_whose_endpoint_is_gone_becomes_a_handoff() -> None:
    call = follow_up_of_a_remembered_turn()
    held = next(e for e in call.context.fleet.decode.endpoints if e.url == DECODES[1])
    held.acquire()  # the endpoint is taken by this very call's first attempt, then tried
    call.decode.tried.append(held)
    assert call.decode_request() is None  # the flow runs its prefill, then opens the decode anew
    assert (
        call.record.outcome is Outcome.DISAGGREGATED
        and call.remote.decision is not None
        and call.remote.decision.remote_prefill
    )
    assert (
        call.remote.decision.estimate is not None and call.remote.decision.estimate.match is Match.ENDPOINT_UNAVAILABLE
    )
    assert "kv_transfer_params" in sent(prefilled(call))


def test_decide_takes_the_conversation_home_when_the_memory_names_no_endpoint() -> None:
    options = PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODES)
    endpoint = Fleet(options, asynchronous=False).decode.endpoints[1]
    home = RouteDecision("rendezvous", endpoint, rule="key")
    assert remote_prefill_decision("always", None, SETTINGS, home).decode_endpoint == DECODES[1]
    assert remote_prefill_decision("always", None, SETTINGS, None).decode_endpoint is None
    cached = Estimate(1000, 10, DECODES[0], Match.EXTENDS_ANSWER)
    decision = remote_prefill_decision("auto", cached, SETTINGS, home)
    assert (decision.remote_prefill, decision.reason, decision.decode_endpoint) == (
        False,
        Reason.DECODE_ONLY_FASTER,
        DECODES[0],
    )


def test_only_a_stream_whose_answer_has_begun_counts_against_the_stall_budget() -> None:
    """A call waiting for its first token on the decode endpoint would pay a decode-only turn's
    prefill in its time to first token; one whose answer is arriving, between its tokens."""
    fleet = Fleet(PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODES), asynchronous=False)
    follow_up = Estimate(1000, 200, DECODES[0], Match.EXTENDS_ANSWER)  # priors: 210 ms decode-only, 266 P/D

    def decided() -> Decision:
        return remote_prefill_decision("auto", follow_up, SETTINGS, None, fleet)

    assert decided().reason is Reason.DECODE_ONLY_FASTER
    other = make_call(chat("another conversation"), fleet=fleet)
    assert other.decode.pin(DECODES[0], "held") == DECODES[0]
    other.decode.start(other.request)
    assert decided().reason is Reason.DECODE_ONLY_FASTER  # in flight, its first token not yet there
    other.first_byte()
    over = decided()
    assert over.reason is Reason.STALL_OVER_BUDGET and over.costs is not None
    assert (over.costs.streams, over.costs.stall_ms) == (1, over.costs.decode_only_ms)
    other.decode.end(200, None)
    endpoint = fleet.decode.endpoints[0]
    assert (endpoint.streaming, endpoint.in_flight) == (0, 0)
    assert decided().reason is Reason.DECODE_ONLY_FASTER


def test_the_stall_budget_bounds_what_the_turns_admitted_during_one_answer_add_up_to() -> None:
    """Each decode-only turn admitted while a stream runs stalls it again: the budget is a
    bound on their sum for that stream, not on each turn alone."""
    fleet = Fleet(PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODES), asynchronous=False)
    settings = ConversationSettings(max_decode_stall_ms=300.0)
    follow_up = Estimate(1000, 200, DECODES[0], Match.EXTENDS_ANSWER)  # priors: 210 ms decode-only, 266 P/D

    def decided() -> Decision:
        return remote_prefill_decision("auto", follow_up, settings, None, fleet)

    def streaming() -> Call:
        call = make_call(chat("another conversation"), fleet=fleet)
        assert call.decode.pin(DECODES[0], "held") == DECODES[0]
        call.decode.start(call.request)
        call.first_byte()
        return call

    oldest = streaming()
    first = decided()
    assert first.reason is Reason.DECODE_ONLY_FASTER and first.costs is not None
    assert (first.costs.charged_ms, first.costs.stall_ms) == (0.0, pytest.approx(210.0))
    second = decided()  # 210 ms charged to the running stream already, 420 with this one
    assert second.reason is Reason.STALL_OVER_BUDGET and second.costs is not None
    assert second.costs.charged_ms == pytest.approx(210.0)
    assert decided().reason is Reason.STALL_OVER_BUDGET  # a handoff charges nobody
    newer = streaming()  # uncharged, but the oldest stream still runs
    assert decided().reason is Reason.STALL_OVER_BUDGET
    oldest.decode.end(200, None)
    assert decided().reason is Reason.DECODE_ONLY_FASTER  # the newer stream had nothing charged
    assert decided().reason is Reason.STALL_OVER_BUDGET
    newer.decode.end(200, None)
    assert fleet.decode.endpoints[0].stalls.most_charged_ms() == 0.0


def test_a_handoff_after_all_counts_the_whole_prompt_as_uncached() -> None:
    cached = Estimate(1000, 10, DECODES[0], Match.EXTENDS_ANSWER)
    after = handoff_after_all(Decision(False, Reason.DECODE_ONLY_FASTER, DECODES[0], cached), SETTINGS)
    assert after.remote_prefill and after.estimate == Estimate(1000, 1000, None, Match.ENDPOINT_UNAVAILABLE)
    empty = Estimate(0, 0, DECODES[0], Match.EXTENDS_ANSWER)
    assert handoff_after_all(Decision(False, Reason.DECODE_ONLY_FASTER, None, empty), SETTINGS).remote_prefill
    assert handoff_after_all(Decision(False, Reason.MODE_NEVER, None, None), SETTINGS).reason is Reason.NO_ESTIMATE


def test_a_response_building_on_stored_state_is_decode_only() -> None:
    call = make_call({"model": "m", "input": "and?", "previous_response_id": "resp_1"}, "/responses")
    assert not call.wants_prefill()
    assert call.record.outcome is Outcome.DECODE_ONLY and call.remote.stored_state == "previous_response_id"
    assert call.trace().remote_prefill_reason == "stored_state"


# -- the legs' bodies per API --------------------------------------------------------------


def test_chat_legs_one_token_prefill_then_the_decode_with_its_ids_and_kv() -> None:
    call = make_call(chat("hi"), remote_prefill="always")
    assert call.wants_prefill()
    prefill = call.prefill_request()
    body = sent(prefill)
    assert (body["stream"], body["max_tokens"], body["return_token_ids"]) == (False, 1, True)
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill.headers["x-request-id"] == call.leg_request_id and "connection" not in prefill.headers
    decode = sent(prefilled_after(call, prefill))
    assert decode["stream"] is True and decode["max_tokens"] == 8
    assert decode["kv_transfer_params"]["remote_engine_id"] == NIXL_PARAMS["remote_engine_id"]
    assert decode["kv_transfer_params"]["prompt_token_ids"] == call_ids(call)
    # Streamed, with a second decode endpoint: armed, its decode streams the ids a continuation needs.
    assert call.migration is not None and call.migration.armed and decode["return_token_ids"] is True


def prefilled_after(call: Call, prefill: httpx.Request) -> httpx.Request:
    assert call.check_prefill(httpx.Response(200, json=prefill_json(sent(prefill)))) is None
    return call.decode_request()


def call_ids(call: Call) -> list[int]:
    assert call.prefill_result is not None and call.prefill_result.ids is not None
    ids: list[int] = json.loads(call.prefill_result.ids)
    return ids


def rendered_answer(ids: list[int]) -> dict[str, Any]:
    """A Responses or Messages prefill's answer: the prompt's ids in its ``kv_transfer_params``."""
    return {"usage": {"input_tokens": len(ids)}, "kv_transfer_params": {**NIXL_PARAMS, "prompt_token_ids": ids}}


@pytest.mark.parametrize(
    ("path", "body", "one_token"),
    [
        ("/responses", {"model": "m", "input": "hi", "stream": True}, "max_output_tokens"),
        ("/messages", {"model": "m", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}]}, "max_tokens"),
    ],
)
def test_rendered_apis_ask_the_prefill_for_the_prompts_ids_and_forward_them(
    path: str, body: dict[str, Any], one_token: str
) -> None:
    call = make_call(body, path, remote_prefill="always")
    assert call.wants_prefill()
    prefill = sent(call.prefill_request())
    assert prefill[one_token] == 1 and prefill["stream"] is False
    assert prefill["kv_transfer_params"]["return_prompt_token_ids"] is True
    assert call.check_prefill(httpx.Response(200, json=rendered_answer([5, 6, 7]))) is None
    decode = sent(call.decode_request())
    assert decode["kv_transfer_params"]["prompt_token_ids"] == [5, 6, 7]
    assert "return_prompt_token_ids" not in decode["kv_transfer_params"]
    assert call.migration is not None and not call.migration.armed  # their events carry no ids
    assert call.trace().forwarded_tokens == 3


def test_a_secret_signs_every_leg_body_pdclient_built_and_only_those() -> None:
    request = httpx.Request("POST", f"{DECODES[0]}/chat/completions", content=b"{}", headers={"x-request-id": "x"})
    unsigned = LegRequests(request, "r1", "/chat/completions", None).signed(PREFILL, b"{}")
    assert SIGNATURE_HEADER not in unsigned.headers and unsigned.headers["x-request-id"] == "r1"
    requests = LegRequests(request, "r1", "/chat/completions", "s" * 32)
    one, two = requests.signed(PREFILL, b"{}"), requests.signed(PREFILL, b"{}")
    assert one.headers[SIGNATURE_HEADER] != two.headers[SIGNATURE_HEADER]  # a fresh nonce per attempt
    assert str(one.url) == f"{PREFILL}/chat/completions"
    assert SIGNATURE_HEADER not in requests.build(DECODES[1], b"{}").headers


# -- dispatch ------------------------------------------------------------------------------


def learnt(call: Call, params: dict[str, Any]) -> None:
    call.context.fleet.coordinates.learn(PREFILL, json.dumps(params).encode())


@pytest.mark.parametrize(
    ("mode", "params", "expected"),
    [
        ("sequential", PUSH, dispatch.SEQUENTIAL),
        ("auto", PUSH, dispatch.CONCURRENT),
        ("auto", {**PUSH, "transfer_mode": None}, dispatch.SEQUENTIAL),
        ("concurrent", {**PUSH, "transfer_mode": None}, dispatch.CONCURRENT),
        ("concurrent", {**PUSH, "transfer_mode": "pull"}, dispatch.SEQUENTIAL),
        ("concurrent", None, dispatch.SEQUENTIAL),  # the first call to an endpoint: nothing learnt
    ],
)
def test_dispatch_goes_concurrent_only_on_learnt_coordinates_its_mode_accepts(
    mode: str, params: dict[str, Any] | None, expected: str
) -> None:
    call = make_call(chat("hi"), remote_prefill="always", dispatch=mode)
    if params is not None:
        learnt(call, params)
    assert call.wants_prefill()
    sent_with = dispatch.concurrent_decode(call)
    assert call.record.dispatch == expected and (sent_with is not None) is (expected == dispatch.CONCURRENT)
    if sent_with is not None:
        kv = sent(sent_with.request)["kv_transfer_params"]
        assert kv["do_remote_prefill"] is True and kv["remote_block_ids"] == []
        assert kv["remote_request_id"] == call.leg_request_id and "prompt_token_ids" not in kv
        # The prefill's first attempt goes to the endpoint the decode registered with.
        assert call.prefill_request().url.host == "p"


def test_a_concurrent_decode_falls_back_to_sequential_when_no_decode_admits() -> None:
    call = make_call(chat("hi"), remote_prefill="always", dispatch="concurrent")
    learnt(call, PUSH)
    assert call.wants_prefill()
    for endpoint in call.context.fleet.decode.endpoints:
        endpoint.trip()
    assert dispatch.concurrent_decode(call) is None and call.record.dispatch == dispatch.SEQUENTIAL


def test_a_concurrent_decode_that_moved_on_is_sent_again_sequentially() -> None:
    call = make_call(chat("hi"), remote_prefill="always", dispatch="concurrent")
    learnt(call, PUSH)
    assert call.wants_prefill()
    concurrent = dispatch.concurrent_decode(call)
    assert concurrent is not None
    prefill = call.prefill_request()
    restarted = {**PUSH, "remote_engine_id": "restarted"}
    assert call.check_prefill(httpx.Response(200, json=prefill_json(sent(prefill), kv_params=restarted))) is None
    why = dispatch.moved_on(call.prefill_result, call.context.fleet.coordinates.get(PREFILL), concurrent.coordinates)
    assert why is not None and "restarted" in why.why
    sequential_again(call, why)
    assert call.record.dispatch == dispatch.SEQUENTIAL and call.record.fallback is not None
    decode = sent(call.decode_request())
    assert decode["kv_transfer_params"]["remote_engine_id"] == "restarted"
    assert decode["kv_transfer_params"]["prompt_token_ids"] == call_ids(call)


# -- what goes back to the caller ----------------------------------------------------------


def test_the_usage_is_merged_only_for_a_disaggregated_200() -> None:
    call = make_call(chat("hi"), remote_prefill="always")
    assert call.wants_prefill()
    prefilled(call)
    result, dialect = call.prefill_result, call.dialect
    sse, json_type = "text/event-stream", "application/json"
    merge = usage_merge_for(dialect, Outcome.DISAGGREGATED, result, 200, sse)
    assert merge is not None and merge.stream
    as_json = usage_merge_for(dialect, Outcome.DISAGGREGATED, result, 200, json_type)
    assert as_json is not None and not as_json.stream
    assert usage_merge_for(dialect, Outcome.DECODE_ONLY, result, 200, sse) is None
    assert usage_merge_for(dialect, Outcome.PREFILL_FAILED, None, 200, sse) is None
    assert usage_merge_for(dialect, Outcome.DISAGGREGATED, result, 500, sse) is None


def test_only_a_decode_only_chat_stream_asks_for_the_usage_the_caller_did_not() -> None:
    def plan_of(body: dict[str, Any], path: str = "/chat/completions") -> Any:
        plan = make_call(body, path).plan
        assert plan is not None
        return plan

    assert asks_usage(plan_of(chat("hi")), collecting=True, decode_only=True)
    assert not asks_usage(plan_of(chat("hi")), collecting=True, decode_only=False)
    assert not asks_usage(plan_of(chat("hi")), collecting=False, decode_only=True)
    assert not asks_usage(plan_of(chat("hi", stream=False)), collecting=True, decode_only=True)
    # A caller that turned usage off is asked for it all the same (and sees none): it is the
    # turn's prompt length. One that asked for it gets it anyway.
    turned_off = chat("hi", stream_options={"include_usage": False})
    assert asks_usage(plan_of(turned_off), collecting=True, decode_only=True)
    assert asks_usage(plan_of(chat("hi", stream_options=None)), collecting=True, decode_only=True)
    owned = chat("hi", stream_options={"include_usage": True})
    assert not asks_usage(plan_of(owned), collecting=True, decode_only=True)
    responses = {"model": "m", "input": "hi", "stream": True}
    assert not asks_usage(plan_of(responses, "/responses"), collecting=True, decode_only=True)


def test_the_answers_ids_are_tagged_in_json_and_event_streams_only() -> None:
    stream = id_tags_for(True, DECODES[0], 200, "text/event-stream; charset=utf-8", None)
    body = id_tags_for(True, DECODES[0], 200, "application/json", None)
    assert stream is not None and stream.stream and body is not None and not body.stream
    assert id_tags_for(True, DECODES[0], 200, "text/plain", None) is None
    assert id_tags_for(True, DECODES[0], 404, "application/json", None) is None
    assert id_tags_for(True, None, 200, "application/json", None) is None
    assert id_tags_for(False, DECODES[0], 200, "application/json", None) is None


def test_the_callers_steps_parse_the_usage_event_alone_and_the_answer_is_read_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import pdclient.handoff._to_caller as to_caller

    parsed: list[bytes] = []
    real = to_caller.event_json

    def counted(raw: bytes) -> object:
        parsed.append(raw)
        return real(raw)

    monkeypatch.setattr(to_caller, "event_json", counted)
    call = make_call(chat("hi"), remote_prefill="never")
    assert not call.wants_prefill() and call.remote.conversation is not None
    call.prefill_result = None
    chunks = [
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop"}]},
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}},
    ]
    body = b"".join(b"data: " + json.dumps(c).encode() + b"\r\n\r\n" for c in chunks) + b"data: [DONE]\r\n\r\n"
    caller = call.caller_body
    strip = usage_strip()
    caller.begin("text/event-stream", None, None, strip)
    out = b"".join(caller.feed(body[i : i + 5]) for i in range(0, len(body), 5)) + caller.rest()
    # On the way, the strip's usage event alone is parsed (a CRLF cut between two reads
    # completes its event as a bare LF, which holds no data); the collector reads the
    # decode's bytes once asked, every event of them.
    assert [raw for raw in parsed if raw.strip()] == [b"data: " + json.dumps(chunks[2]).encode() + b"\r\n\r"]
    assert b'"usage"' not in out and out.endswith(b"data: [DONE]\r\n\r\n")
    assert call.remote.conversation.collector.answer() == Answer("Hello", (), 2, False)


def test_a_tracked_streams_events_reach_the_callers_steps_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream that may move is parsed by its tracker; the collector and the usage strip
    read what it parsed (its ids taken out, as from the bytes), not the bytes again."""
    import pdclient.wire._sse as sse
    from pdclient.migration import Tracker

    reparsed: list[bytes] = []
    real = sse.event_data

    def counted(raw: bytes) -> bytes | None:
        reparsed.append(raw)
        return real(raw)

    monkeypatch.setattr(sse, "event_data", counted)
    call = make_call(chat("hi"), remote_prefill="never")
    assert not call.wants_prefill() and call.remote.conversation is not None
    call.prefill_result = None
    chunks = [
        {
            "id": "c",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
            "prompt_token_ids": [1, 2],
        },
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "Hel"}, "finish_reason": None, "token_ids": [7]}]},
        {"id": "c", "choices": [{"index": 0, "delta": {"content": "lo"}, "finish_reason": "stop", "token_ids": [8]}]},
        {"id": "c", "choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}},
    ]
    body = b"".join(b"data: " + json.dumps(c, separators=(",", ":")).encode() + b"\n\n" for c in chunks)
    body += b"data: [DONE]\n\n"
    caller = call.caller_body
    caller.begin("text/event-stream", None, None, usage_strip())
    tracker = Tracker(chat=True, keep_ids=False, want_prompt_ids=True)
    out = b"".join(caller.events(tracker.events(body[i : i + 7])) for i in range(0, len(body), 7))
    assert reparsed == []
    assert tracker.prompt_ids == [1, 2] and tracker.ids == [7, 8]
    assert b"token_ids" not in out and b'"usage"' not in out and out.endswith(b"data: [DONE]\n\n")
    assert call.remote.conversation.collector.answer() == Answer("Hello", (), 2, False)
    # The one event the tracker passes on unparsed, [DONE], is a single data line: read unframed.
    assert reparsed == []


def test_reads_of_whole_events_without_usage_pass_unframed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stream whose steps read only its usage event (the merge, the strip) passes a read of
    whole events that holds no usage on as it came, without splitting it into events: a
    streamed answer is read a token at a time. What it holds back, it still frames."""
    import pdclient.wire._sse as sse

    framed: list[bytes] = []
    real = sse.SSEFramer.feed

    def counted(self: Any, data: bytes) -> list[bytes]:
        framed.append(data)
        return real(self, data)

    monkeypatch.setattr(sse.SSEFramer, "feed", counted)
    call = make_call(chat("hi"), remote_prefill="always")
    caller = call.caller_body
    caller.begin("text/event-stream", None, None, usage_strip())
    tokens = [b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"w%d"}}]}\n\n' % i for i in range(3)]
    assert [caller.feed(read) for read in tokens] == tokens
    assert caller.feed(tokens[0] + tokens[1]) == tokens[0] + tokens[1]
    assert framed == []
    usage = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":2,"completion_tokens":3}}\n\n'
    assert caller.feed(usage) == b"" and framed == [usage]  # the asked usage, taken out
    half = len(tokens[2]) // 2
    assert caller.feed(tokens[2][:half]) == b""  # held until its end
    assert caller.feed(tokens[2][half:]) == tokens[2]  # framed: the framer held its start
    assert caller.feed(b"data: [DONE]\r\n\r\n") == b"data: [DONE]\r\n\r\n"
    assert caller.rest() == b""


def usage_strip() -> Any:
    from pdclient.wire import UsageStrip

    return UsageStrip()


# -- the KV release ------------------------------------------------------------------------


def abandoned_handoff() -> Call:
    """A handoff whose prefill answered (holding KV) and whose decode never went out."""
    call = make_call(chat("hi"), remote_prefill="always")
    assert call.wants_prefill()
    request = call.prefill_request()
    assert call.check_prefill(httpx.Response(200, json=prefill_json(sent(request)))) is None
    return call


def test_every_release_is_bounded_by_its_own_timeout_never_the_callers() -> None:
    call = abandoned_handoff()
    abandoned = release_request(call)
    assert abandoned is not None
    leg, request = abandoned
    assert leg.name == "release" and sent(request)["max_tokens"] == 1
    assert request.extensions["timeout"] == dict.fromkeys(("connect", "read", "write", "pool"), RELEASE_TIMEOUT)
    moved = release_leg(call, b"{}", "a-continuation")  # a moved stream's continuation prefill
    assert moved is not None and moved[1].headers["x-request-id"] == "a-continuation"
    assert moved[1].extensions["timeout"] == request.extensions["timeout"]


def test_with_every_breaker_open_a_release_tries_one_endpoint_the_decode_did_not() -> None:
    call = abandoned_handoff()
    pool = call.context.fleet.decode
    for endpoint in pool.endpoints:
        endpoint.trip()
    call.decode.tried.append(pool.endpoints[0])  # it failed this call
    pending = release_leg(call, b"{}")
    assert pending is not None
    leg, request = pending
    assert str(request.url).startswith(DECODES[1]) and leg.decision is not None
    assert leg.decision.rule == "breaker_open"
    leg.end(None, httpx.ConnectError("refused"))
    call.decode.tried.append(pool.endpoints[1])
    assert release_leg(call, b"{}") is None, "every endpoint failed this call: the blocks expire with the lease"


def test_no_release_once_a_decode_may_have_reached_its_server_or_without_kv_held() -> None:
    call = abandoned_handoff()
    call.decode_may_have_reached = True
    assert release_request(call) is None  # it would be a second pull
    call = make_call(chat("hi"), remote_prefill="always")
    assert call.wants_prefill()
    request = call.prefill_request()
    assert call.check_prefill(httpx.Response(200, json=prefill_json(sent(request), kv_params=None))) is None
    assert release_request(call) is None
