"""The observer seam: one observer class sees every event of every kind of call, sync and async."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
import respx

from pdclient import CallView, LegView, Outcome, PDObserver, PDTrace, RetrySettings
from tests.fake_vllm import DECODE, PREFILL
from tests.twins import Twin

MESSAGES = [{"role": "user", "content": "Is it up?"}]
FAST = RetrySettings(prefill_attempts=2, backoff_initial=0.001, backoff_max=0.01)


class Recorder(PDObserver):
    """Writes down every event, in order, as short strings; checks the views on the way."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.traces: list[PDTrace] = []

    def on_call_start(self, call: CallView) -> None:
        assert call.request_id and isinstance(call.request, httpx.Request) and call.started > 0
        call.data[self] = "mine"
        self.events.append(f"start {call.route}")

    def on_leg_start(self, call: CallView, leg: LegView) -> None:
        assert leg.url in (PREFILL, DECODE) and leg.request.url.host in ("prefill.test", "decode.test")
        assert leg.sent_at >= call.started and call.data[self] == "mine"
        self.events.append(f"{leg.name} {leg.attempt}")

    def on_leg_end(self, call: CallView, leg: LegView, status: int | None, error: BaseException | None) -> None:
        self.events.append(f"{leg.name} {leg.attempt} {status or type(error).__name__}")

    def on_first_byte(self, call: CallView) -> None:
        self.events.append("first byte")

    def on_call_end(self, call: CallView, trace: PDTrace) -> None:
        assert trace.request_id == call.request_id
        self.traces.append(trace)
        self.events.append(f"end {trace.outcome.value}")


def observed(mode: str, **kwargs: Any) -> tuple[Twin, Recorder]:
    recorder = Recorder()
    return Twin(mode, observers=[recorder], retries=FAST, **kwargs), recorder


async def test_a_handoff(mode: str, pd_routes: respx.MockRouter) -> None:
    twin, seen = observed(mode)
    await twin.stream_text(messages=MESSAGES)
    assert seen.events == [
        "start chat",
        "prefill 1",
        "prefill 1 200",
        "decode 1",
        "first byte",
        "decode 1 200",
        "end disaggregated",
    ]
    assert seen.traces[0].forwarded_tokens == len("Is it up?")


async def test_a_fallback(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["prefill"].mock(side_effect=httpx.ConnectError("down"))
    twin, seen = observed(mode)
    await twin.chat(messages=MESSAGES)
    assert seen.events == [
        "start chat",
        "prefill 1",
        "prefill 1 ConnectError",
        "prefill 2",
        "prefill 2 ConnectError",
        "decode 1",
        "first byte",
        "decode 1 200",
        "end prefill_failed",
    ]
    assert seen.traces[0].fallback is not None and seen.traces[0].fallback.startswith("prefill failed, decode-only")


async def test_a_refusal(mode: str, pd_routes: respx.MockRouter) -> None:
    twin, seen = observed(mode)
    with pytest.raises(openai.BadRequestError):
        await twin.chat(messages=MESSAGES, extra_body={"kv_transfer_params": {}})
    assert seen.events == ["start chat", "end refused"]
    assert seen.traces[0].fallback is None and "kv_transfer_params is written by pdclient" in str(seen.traces[0].error)


async def test_a_pass_through(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes.get(f"{DECODE}/models").mock(return_value=httpx.Response(200, json={"data": []}))
    twin, seen = observed(mode)
    await twin.call(twin.client.models.list)
    assert seen.events == ["start passthrough", "decode 1", "first byte", "decode 1 200", "end passthrough"]
    assert seen.traces[0].route == "passthrough"


async def test_a_decode_that_breaks_and_a_release(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["decode"].mock(side_effect=[httpx.ConnectError("down")] * 2 + [httpx.Response(200, json={})])
    twin, seen = observed(mode)
    with pytest.raises(openai.APIConnectionError):
        await twin.chat(messages=MESSAGES)
    assert seen.events == [
        "start chat",
        "prefill 1",
        "prefill 1 200",
        "decode 1",
        "decode 1 ConnectError",
        "decode 2",
        "decode 2 ConnectError",
        "release 1",
        "release 1 200",
        "end failed",
    ]
    assert seen.traces[0].outcome is Outcome.FAILED


async def test_an_observer_that_raises_never_fails_the_call(
    mode: str, pd_routes: respx.MockRouter, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(PDObserver):
        def on_leg_start(self, call: CallView, leg: LegView) -> None:
            raise RuntimeError("observer bug")

    twin, seen = observed(mode)
    twin = Twin(mode, observers=[Broken(), *twin.client.pd_options.observers])
    completion = await twin.chat(messages=MESSAGES)
    assert completion.choices[0].message.content == "echo:Is it up?"
    assert seen.events[-1] == "end disaggregated"
    assert "observer bug" in caplog.text


def test_observers_and_on_trace_survive_with_options(pd_routes: respx.MockRouter) -> None:
    traces: list[PDTrace] = []
    twin, seen = observed("sync", on_trace=traces.append)
    copy = twin.client.with_options(timeout=5, on_prefill_failure="fail")
    copy.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[call-overload]
    assert seen.events[-1] == "end disaggregated" and len(traces) == 1
