"""A call as one flow of steps (``pdclient.handoff.call_flow``), driven by hand: no HTTP.

The flow yields the I/O it needs and is sent what the network gave (or has the failure
thrown in); these tests play the driver's part and check the steps and their order, so a
decision can be read here without a transport.
"""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any

import httpx
import pytest

from pdclient import AsyncPDTransport, Outcome, PDOptions, PDTransport, wire
from pdclient._observe import Observers
from pdclient.fleet import Fleet
from pdclient.handoff import Call, CallContext, CallRecord, EffectiveOptions, call_flow, dispatch, steps
from pdclient.handoff import steps as handoff_steps
from pdclient.handoff._failure import error_response
from pdclient.pools import RetrySettings
from pdclient.wire import error_body
from tests.fake_vllm import prefill_json

PREFILL = "http://p:8100/v1"
DECODE = "http://d:8200/v1"
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True, "max_tokens": 5}


def new_call(**options: Any) -> Call:
    settings = PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODE, **options)
    context = CallContext(options=settings, fleet=Fleet(settings, asynchronous=False), observers=Observers([]))
    return Call(context, httpx.Request("POST", f"{DECODE}/chat/completions", json=BODY))


def drive(call: Call, answer: dict[type, list[Any]]) -> tuple[list[handoff_steps.Step], Any]:
    """Run the call's flow, answering each step with the next of ``answer[type]`` (an
    exception is thrown in, a callable is called with the step)."""
    run = steps.FlowRun(call_flow(call))
    seen: list[handoff_steps.Step] = []
    for step in run:
        seen.append(step)
        given = answer[type(step)].pop(0) if answer.get(type(step)) else None
        result = given(step) if callable(given) and not isinstance(given, type) else given
        with run:  # as the drivers resume it: an exception is thrown into the flow
            if isinstance(result, BaseException):
                raise result
            run.result = result
    return seen, run.value


def stream(step: handoff_steps.Stream) -> httpx.ByteStream:
    return httpx.ByteStream(b"")


def test_a_sequential_handoff_is_its_prefill_then_its_decode() -> None:
    call = new_call()
    steps, response = drive(
        call,
        {
            handoff_steps.SendPrefill: [httpx.Response(200, json=prefill_json(BODY))],
            handoff_steps.Open: [httpx.Response(200, headers={"content-type": "text/event-stream"})],
            handoff_steps.Stream: [stream],
        },
    )
    assert [type(s) for s in steps] == [
        handoff_steps.ReadRequest,
        handoff_steps.SendPrefill,
        handoff_steps.Open,
        handoff_steps.Stream,
    ]
    assert response.status_code == 200 and call.record.dispatch == "sequential"
    prefill, decode = steps[1], steps[2]
    assert isinstance(prefill, handoff_steps.SendPrefill) and isinstance(decode, handoff_steps.Open)
    assert prefill.request.url.host == "p" and decode.request.url.host == "d" and not prefill.outlive


def test_a_busy_prefill_is_tried_again_after_a_sleep_step() -> None:
    call = new_call(retries=RetrySettings(backoff_initial=0.5, backoff_max=0.5))
    steps, response = drive(
        call,
        {
            handoff_steps.SendPrefill: [httpx.Response(503), httpx.Response(200, json=prefill_json(BODY))],
            handoff_steps.Open: [httpx.Response(200, headers={"content-type": "text/event-stream"})],
            handoff_steps.Stream: [stream],
        },
    )
    assert [type(s) for s in steps] == [
        handoff_steps.ReadRequest,
        handoff_steps.SendPrefill,
        handoff_steps.Sleep,
        handoff_steps.SendPrefill,
        handoff_steps.Open,
        handoff_steps.Stream,
    ]
    sleep = steps[2]
    assert isinstance(sleep, handoff_steps.Sleep) and 0.5 <= sleep.seconds <= 1.0 and response.status_code == 200


def test_a_decode_that_never_opens_releases_the_prefill_before_the_error_goes_on() -> None:
    steps = call_flow(new_call())
    seen = [next(steps), steps.send(None), steps.send(httpx.Response(200, json=prefill_json(BODY)))]
    seen.append(steps.throw(KeyboardInterrupt()))  # a Ctrl-C while the decode's headers are awaited
    assert [type(s) for s in seen] == [
        handoff_steps.ReadRequest,
        handoff_steps.SendPrefill,
        handoff_steps.Open,
        handoff_steps.Release,
    ]
    release = seen[-1]
    assert isinstance(release, handoff_steps.Release) and release.leg.name == "release"
    assert json.loads(release.request.content)["kv_transfer_params"]["do_remote_prefill"] is True
    with pytest.raises(KeyboardInterrupt):
        steps.send(None)  # the release sent: the interrupt goes on


@pytest.mark.parametrize("transport", [PDTransport, AsyncPDTransport])
def test_a_copy_with_other_options_shares_its_transports_driver(transport: type[PDTransport]) -> None:
    # One way to build a transport's state: the copy has every attribute, the driver (its
    # connections, the prefills outliving their callers) shared, not rebuilt beside it.
    original = transport(prefill_base_url=PREFILL, decode_base_url=DECODE)
    copy = original.with_options(original.options.replace(on_prefill_failure="decode"))
    assert copy._driver is original._driver and copy.options.on_prefill_failure == "decode"
    assert vars(copy).keys() == vars(original).keys()


def test_a_call_keeps_its_record_apart_and_its_options_resolved_once() -> None:
    call = new_call(on_prefill_failure="decode", dispatch="auto")
    call.request = httpx.Request(
        "POST", f"{DECODE}/chat/completions", json={**BODY, "pdclient": {"max_decode_migrations": 0}}
    )
    call.request.read()
    assert call.plan_or_refuse() is None
    assert call.effective == EffectiveOptions(
        on_prefill_failure="decode", dispatch="auto", remote_prefill="auto", max_decode_migrations=0
    )
    assert call.record == CallRecord(Outcome.DISAGGREGATED)  # what the report reads, nothing else


def test_the_dispatch_decisions_take_values_and_return_decisions() -> None:
    here = dispatch.Coordinates("e1", "p", 5600, 1, 1, "push")
    elsewhere = dispatch.Coordinates("e2", "p", 5600, 1, 1, "push")
    assert dispatch.moved_on(None, here, here) == dispatch.FallBack("the prefill failed")
    result = wire.PrefillResult(ids=b"[1,2]", count=2, kv_transfer_params=None)
    assert dispatch.moved_on(result, here, here) is None
    moved = dispatch.moved_on(result, elsewhere, here)
    assert moved is not None and moved.reason == dispatch.PREFILL_MOVED
    book = dispatch.CoordinateBook()
    assert dispatch.prompt_drift(book, here, b"[1,2]", [1, 2]) is None
    drift = dispatch.prompt_drift(book, here, b"[1,2]", [1, 3])
    assert drift is not None and drift.reason == dispatch.PROMPT_DRIFT and book.is_sequential_only(here)


def test_a_failed_calls_error_body_is_the_one_the_proxy_and_stream_error_events_use() -> None:
    response = error_response(502, "the prefill leg failed", {"x-pd-failed-leg": "prefill"})

    assert response.json() == {"error": error_body("pdclient: the prefill leg failed", 502)}
    assert response.content == (
        b'{"error":{"message":"pdclient: the prefill leg failed","type":"pdclient_error","code":502}}'
    )
    assert response.headers["content-type"] == "application/json"
    assert response.headers["x-pd-failed-leg"] == "prefill"


def test_the_decode_pools_own_admitted_list_says_which_endpoints_a_call_may_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    call = new_call(on_prefill_failure="decode")
    pool = call.context.fleet.decode
    assert pool is not None and pool.admitted()
    assert call.decode.pin(DECODE, "conversation") == DECODE
    call.decode.tried.clear()

    # One rule of admission, the pool's: whatever it leaves out, the call does not go to.
    monkeypatch.setattr(type(pool), "admitted", lambda self, exclude=(), members=None: [])
    assert not pool.admitted()
    assert call.decode.pin(DECODE, "conversation") is None


def test_a_flow_run_sends_each_steps_result_or_throws_its_exception_and_keeps_the_return() -> None:
    seen: list[Any] = []

    def flow() -> Generator[str, Any, str]:
        seen.append((yield "first"))
        try:
            yield "fails"
        except KeyError as exc:
            seen.append(exc)
        seen.append((yield "unanswered"))
        return "done"

    run = steps.FlowRun(flow())
    for step in run:
        with run:
            if step == "first":
                run.result = 1
            elif step == "fails":
                raise KeyError("x")
    assert seen[0] == 1 and isinstance(seen[1], KeyError) and seen[2] is None
    assert run.value == "done"
