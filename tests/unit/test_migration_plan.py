"""A broken stream's move as steps (``pdclient.handoff.move``), driven by hand: no HTTP.

The generator yields what needs the network and is sent what it got (or has the failure
thrown in); these tests play the network's part and check the steps, their order, the
legs and the error the caller would get.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from pdclient import PDOptions
from pdclient._observe import Observers
from pdclient.fleet import Fleet
from pdclient.handoff import RELEASE_TIMEOUT, Call, CallContext, move
from pdclient.handoff import steps as handoff_steps
from tests.fake_vllm import prefill_json

PREFILL = "http://p:8100/v1"
DECODES = ["http://d1:8200/v1", "http://d2:8200/v1"]
SSE = {"content-type": "text/event-stream"}
CUT = httpx.ReadError("connection reset")


def chunk(text: str, ids: list[int], finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "finish_reason": finish, "token_ids": ids}
    body = {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def streaming_call(prompt: str, *, answered: bool = False) -> Call:
    """A disaggregated chat call whose decode stream has delivered two tokens (or its whole answer)."""
    options = PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODES, max_decode_migrations=1)
    context = CallContext(options=options, fleet=Fleet(options, asynchronous=False), observers=Observers([]))
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "stream": True, "max_tokens": 50}
    request = httpx.Request("POST", f"{DECODES[0]}/chat/completions", json=body)
    call = Call(context, request)
    assert call.plan_or_refuse() is None and call.wants_prefill()
    call.prefill_request()
    assert call.check_prefill(httpx.Response(200, json=prefill_json(body))) is None
    call.decode_request()
    assert call.migration is not None and call.migration.tracker is not None
    tracker = call.migration.tracker
    tracker.feed(chunk("Hel", [1]) + chunk("lo", [2], "stop" if answered else None))
    call.decode.status = 200
    return call


def drive(
    call: Call, answers: dict[type, Any], seen: list[handoff_steps.Step] | None = None
) -> tuple[list[handoff_steps.Step], Any]:
    """Run the move, answering each step from ``answers`` (an exception is thrown in)."""
    assert call.migration is not None
    run = handoff_steps.FlowRun(move(call, call.migration, CUT, received=100))
    seen = [] if seen is None else seen
    for step in run:
        seen.append(step)
        result = answers[type(step)]
        with run:  # as the drivers resume it: an exception is thrown into the move
            if isinstance(result, BaseException):
                raise result
            run.result = result
    return seen, run.value


def test_a_short_prompt_moves_to_the_other_decode_endpoint_in_one_step() -> None:
    call = streaming_call("hi")
    first = call.decode.url
    continuation = httpx.Response(200, headers=SSE)
    steps, response = drive(call, {handoff_steps.OpenDecode: continuation})
    assert [type(s) for s in steps] == [handoff_steps.OpenDecode] and response is continuation
    assert call.migration is not None and call.migration.pending is None
    [record] = call.migration.records()
    assert record.from_url == first and record.route == "decode" and record.after_tokens == 2


def test_the_continuation_request_is_built_while_its_decode_opens() -> None:
    call = streaming_call("hi")
    assert call.migration is not None
    steps = move(call, call.migration, CUT, received=100)
    assert isinstance(next(steps), handoff_steps.OpenDecode)
    request = call.decode_request()  # what the driver's open_decode does
    assert request.headers["x-request-id"].endswith("-m1") and str(request.url).startswith(DECODES[1])
    sent = json.loads(request.content)
    assert sent["max_tokens"] == 48 and sent["kv_transfer_params"]["prompt_token_ids"][-2:] == [1, 2]


def test_a_long_prompt_goes_through_a_prefill_and_a_failed_one_falls_back_to_the_decode_route() -> None:
    call = streaming_call("x" * 1100)  # the fake's ids: one per character
    steps, response = drive(
        call,
        {
            handoff_steps.SendPrefill: httpx.ConnectError("refused"),
            handoff_steps.OpenDecode: httpx.Response(200, headers=SSE),
        },
    )
    assert [type(s) for s in steps] == [handoff_steps.SendPrefill, handoff_steps.OpenDecode] and response is not None
    assert call.migration is not None
    [record] = call.migration.records()
    assert record.route == "decode" and "its prefill failed: ConnectError: refused" in record.cause


def test_a_refused_continuation_reads_its_body_and_the_caller_gets_why() -> None:
    call = streaming_call("hi")
    with pytest.raises(openai.APIError, match="answered HTTP 503: busy"):
        drive(call, {handoff_steps.OpenDecode: httpx.Response(503), handoff_steps.ReadRefusal: b"busy"})


def test_a_continuation_that_cannot_connect_is_the_callers_error() -> None:
    call = streaming_call("hi")
    with pytest.raises(openai.APIError, match="the continuation failed: ConnectError"):
        drive(call, {handoff_steps.OpenDecode: httpx.ConnectError("refused")})


def test_an_interrupted_open_after_a_continuation_prefill_releases_its_kv_first() -> None:
    call = streaming_call("x" * 1100)
    prefill_body = prefill_json({"messages": [{"role": "user", "content": "x" * 1100}]})
    prefill_body["prompt_token_ids"] = [120] * 1100 + [1, 2]  # the continuation's prompt
    answers: dict[type, Any] = {
        handoff_steps.SendPrefill: httpx.Response(200, json=prefill_body),
        handoff_steps.OpenDecode: KeyboardInterrupt(),
    }
    answers[handoff_steps.Release] = None
    seen: list[handoff_steps.Step] = []
    with pytest.raises(KeyboardInterrupt):
        drive(call, answers, seen)
    assert [type(s) for s in seen] == [handoff_steps.SendPrefill, handoff_steps.OpenDecode, handoff_steps.Release]
    release = seen[-1]
    assert isinstance(release, handoff_steps.Release) and release.leg.name == "release"
    assert json.loads(release.request.content)["max_tokens"] == 1
    assert release.request.headers["x-request-id"].endswith("-m1")
    assert release.request.extensions["timeout"]["read"] == RELEASE_TIMEOUT  # the caller is leaving
    assert call.migration is not None and call.migration.pending is None


def test_a_stream_cut_after_its_answer_ended_does_not_move() -> None:
    steps, response = drive(streaming_call("hi", answered=True), {})
    assert steps == [] and response is None


def test_a_call_out_of_moves_says_so_without_a_step() -> None:
    call = streaming_call("hi")
    drive(call, {handoff_steps.OpenDecode: httpx.Response(200, headers=SSE)})
    with pytest.raises(openai.APIError, match=r"max_decode_migrations \(1\) reached"):
        drive(call, {})
