"""Fault injection with respx: each case asserts what the caller sees and the call's PDTrace.

Connection-level faults against a real socket are in test_faults_stub.py.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import openai
import pytest
import respx

from pdclient import Outcome, PDTrace
from pdclient.pools import BreakerSettings, RetrySettings
from tests.fake_vllm import DECODE, NIXL_PARAMS, FakeVLLM, chat_json, ids_for, prefill_json
from tests.polling import until
from tests.twins import Twin, status_error

MESSAGES = [{"role": "user", "content": "Is it up?"}]
ANSWER = "echo:Is it up?"
FAST = RetrySettings(backoff_initial=0.001, backoff_max=0.01)


def twin_with_traces(mode: str, **kwargs: Any) -> tuple[Twin, list[PDTrace]]:
    traces: list[PDTrace] = []
    kwargs.setdefault("retries", FAST)
    return Twin(mode, on_trace=traces.append, **kwargs), traces


def decode_body(router: respx.MockRouter, index: int = 0) -> dict[str, Any]:
    return dict(json.loads(router["decode"].calls[index].request.content))


def in_flight(twin: Twin) -> list[int]:
    fleet = twin.client.pd_fleet
    return [e.in_flight for e in (*fleet.prefill.endpoints, *fleet.decode.endpoints)]


@pytest.mark.parametrize(
    ("fault", "reason"),
    [
        (httpx.ConnectError("connection refused"), "ConnectError: connection refused"),
        (httpx.ReadTimeout("timed out"), "ReadTimeout: timed out"),
        (httpx.Response(500, json={"error": {"message": "engine dead"}}), "HTTP 500"),
        (httpx.Response(503, text="overloaded"), "HTTP 503: overloaded"),
    ],
)
async def test_prefill_failure_falls_back_to_decode(
    mode: str, pd_routes: respx.MockRouter, fault: Any, reason: str
) -> None:
    pd_routes["prefill"].mock(side_effect=fault) if isinstance(fault, Exception) else pd_routes["prefill"].mock(
        return_value=fault
    )
    twin, traces = twin_with_traces(mode)
    completion = await twin.chat(messages=MESSAGES)
    assert completion.choices[0].message.content == ANSWER
    assert pd_routes["prefill"].call_count == 3, "three prefill attempts"
    assert "kv_transfer_params" not in decode_body(pd_routes), "decode-only: the caller's body as is"
    (trace,) = traces
    assert trace.fallback is not None
    assert trace.fallback.startswith(f"prefill failed, decode-only: {reason}")
    assert trace.fallback.endswith("(after 3 attempts)")
    assert trace.forwarded_tokens == 0 and in_flight(twin) == [0, 0]


async def test_prefill_429_retry_after_then_success(mode: str, pd_routes: respx.MockRouter) -> None:
    ok = httpx.Response(200, json=prefill_json({"messages": MESSAGES}))
    pd_routes["prefill"].mock(side_effect=[httpx.Response(429, headers={"retry-after": "0.3"}), ok])
    twin, traces = twin_with_traces(mode)
    started = time.monotonic()
    completion = await twin.chat(messages=MESSAGES)
    assert time.monotonic() - started >= 0.3, "Retry-After was honoured"
    assert completion.choices[0].message.content == ANSWER
    assert pd_routes["prefill"].call_count == 2
    assert traces[0].fallback is None and traces[0].forwarded_tokens == len("Is it up?")


async def test_prefill_malformed_json_decodes_without_ids(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["prefill"].mock(return_value=httpx.Response(200, text="{not json"))
    twin, traces = twin_with_traces(mode)
    completion = await twin.chat(messages=MESSAGES)
    assert completion.choices[0].message.content == ANSWER
    assert "kv_transfer_params" not in decode_body(pd_routes)
    assert traces[0].fallback == "ids not forwarded: prefill response is not a JSON object"


async def test_prefill_without_kv_params_forwards_only_ids(mode: str, pd_routes: respx.MockRouter) -> None:
    payload = prefill_json({"messages": MESSAGES})
    del payload["kv_transfer_params"]
    pd_routes["prefill"].mock(return_value=httpx.Response(200, json=payload))
    twin, traces = twin_with_traces(mode)
    await twin.chat(messages=MESSAGES)
    assert decode_body(pd_routes)["kv_transfer_params"] == {"prompt_token_ids": ids_for("Is it up?")}
    assert traces[0].fallback is None


async def test_decode_connection_refused_is_retried_then_a_clean_error(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["decode"].mock(side_effect=httpx.ConnectError("refused"))
    twin, traces = twin_with_traces(mode)
    with pytest.raises(openai.APIConnectionError):
        await twin.chat(messages=MESSAGES)
    await until(lambda: pd_routes["decode"].call_count == 3)
    assert pd_routes["decode"].call_count == 2 + 1, "two decode attempts, then one KV release attempt"
    release = decode_body(pd_routes, 2)
    assert release["max_tokens"] == 1 and release["stream"] is False
    assert traces[0].outcome is Outcome.FAILED and traces[0].fallback is None
    assert traces[0].error is not None and traces[0].error.startswith("ConnectError")
    assert in_flight(twin) == [0, 0]


async def test_decode_500_before_stream_is_not_retried(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["decode"].mock(return_value=httpx.Response(500, json={"error": {"message": "decode engine dead"}}))
    twin, _ = twin_with_traces(mode)
    with pytest.raises(openai.InternalServerError) as excinfo:
        await twin.chat(messages=MESSAGES, stream=True)
    assert status_error(excinfo).response.headers["x-pd-failed-leg"] == "decode"
    assert pd_routes["decode"].call_count == 1, "a status arrived: the decode may have run, never repeat it"
    assert in_flight(twin) == [0, 0]


async def test_decode_disconnect_mid_stream_is_a_clean_api_error(mode: str, pd_routes: respx.MockRouter) -> None:
    from tests.fake_vllm import chat_chunk

    def broken() -> Any:
        yield chat_chunk("half")
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    async def abroken() -> Any:
        for chunk in broken():
            yield chunk

    stream = abroken() if mode == "async" else broken()
    pd_routes["decode"].mock(
        return_value=httpx.Response(200, stream=stream, headers={"content-type": "text/event-stream"})
    )  # type: ignore[arg-type]
    twin, traces = twin_with_traces(mode)
    with pytest.raises(openai.APIConnectionError, match="pdclient: decode stream broke after 1"):
        await twin.stream_text(messages=MESSAGES)
    assert pd_routes["decode"].call_count == 1
    assert traces[0].decode_first_byte_ms is not None
    assert traces[0].outcome is Outcome.FAILED
    assert traces[0].error is not None and traces[0].error.startswith("decode stream broke after")
    assert in_flight(twin) == [0, 0]


async def test_both_legs_down_is_a_clean_connection_error(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["prefill"].mock(side_effect=httpx.ConnectError("prefill refused"))
    pd_routes["decode"].mock(side_effect=httpx.ConnectError("decode refused"))
    twin, traces = twin_with_traces(mode)
    with pytest.raises(openai.APIConnectionError):
        await twin.chat(messages=MESSAGES)
    assert pd_routes["prefill"].call_count == 3 and pd_routes["decode"].call_count == 2
    assert traces[0].fallback is not None and "prefill failed, decode-only" in traces[0].fallback


async def test_per_call_failure_policy_in_extra_body(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["prefill"].mock(side_effect=httpx.ConnectError("refused"))
    twin, traces = twin_with_traces(mode)
    with pytest.raises(openai.APIStatusError) as excinfo:
        await twin.chat(messages=MESSAGES, extra_body={"pdclient": {"on_prefill_failure": "fail"}})
    assert status_error(excinfo).status_code == 502
    assert pd_routes["decode"].call_count == 0
    assert traces[0].outcome is Outcome.FAILED and traces[0].failed_leg == "prefill"
    assert traces[0].error is not None and traces[0].error.startswith("prefill failed: ConnectError")
    with pytest.raises(openai.BadRequestError, match=r"pdclient.on_prefill_failure must be one of"):
        await twin.chat(messages=MESSAGES, extra_body={"pdclient": {"on_prefill_failure": "maybe"}})


async def test_a_per_call_fallback_url_is_refused_when_not_allowed(mode: str, pd_routes: respx.MockRouter) -> None:
    """What a server passing its callers' bodies on (pdclient serve) needs: no caller-chosen URL."""
    twin, traces = twin_with_traces(mode, allow_call_fallback_url=False)
    with pytest.raises(openai.BadRequestError, match="not a fallback URL"):
        await twin.chat(messages=MESSAGES, extra_body={"pdclient": {"on_prefill_failure": "http://127.0.0.1:9/v1"}})
    assert pd_routes["prefill"].call_count == 0 and pd_routes["decode"].call_count == 0
    assert traces[0].outcome is Outcome.REFUSED and traces[0].failed_leg == "client"
    await twin.chat(messages=MESSAGES, extra_body={"pdclient": {"on_prefill_failure": "fail"}})  # a policy: fine
    assert traces[1].outcome is Outcome.DISAGGREGATED


async def test_per_call_options_never_reach_a_server(mode: str, pd_routes: respx.MockRouter) -> None:
    twin, _ = twin_with_traces(mode)
    await twin.chat(messages=MESSAGES, extra_body={"pdclient": {"session": "s-1"}})
    assert "pdclient" not in json.loads(pd_routes["prefill"].calls[0].request.content)
    assert "pdclient" not in decode_body(pd_routes)


async def test_failure_policy_with_options(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["prefill"].mock(return_value=httpx.Response(503, text="busy"))
    twin, _ = twin_with_traces(mode)
    strict = twin.client.with_options(on_prefill_failure="fail")
    with pytest.raises(openai.InternalServerError) as excinfo:
        await twin.chat(strict, messages=MESSAGES)
    assert status_error(excinfo).response.headers["x-pd-failed-leg"] == "prefill"
    assert pd_routes["decode"].call_count == 0


async def test_failure_policy_fallback_endpoint(mode: str, pd_routes: respx.MockRouter) -> None:
    unified = "http://unified.test:9000/v1"
    fallback = pd_routes.post(f"{unified}/chat/completions", name="fallback").mock(
        side_effect=lambda r: httpx.Response(200, json=chat_json("from fallback"))
    )
    pd_routes["prefill"].mock(side_effect=httpx.ConnectError("refused"))
    twin, traces = twin_with_traces(mode, on_prefill_failure=unified)
    completion = await twin.chat(messages=MESSAGES)
    assert completion.choices[0].message.content == "from fallback"
    assert json.loads(fallback.calls[0].request.content) == {"model": "m", "messages": MESSAGES}
    assert pd_routes["decode"].call_count == 0
    assert traces[0].decode_url == unified
    assert traces[0].fallback is not None and traces[0].fallback.startswith(f"prefill failed, sent to {unified}")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


async def test_breaker_opens_skips_and_recovers(mode: str) -> None:
    p1, p2 = "http://p1.test/v1", "http://p2.test/v1"
    with respx.mock(assert_all_called=False) as router:
        bad = router.post(f"{p1}/chat/completions", name="p1").mock(side_effect=httpx.ConnectError("down"))
        good = router.post(f"{p2}/chat/completions", name="p2").mock(
            side_effect=lambda r: httpx.Response(200, json=prefill_json(json.loads(r.content)))
        )
        router.post(f"{DECODE}/chat/completions", name="decode").mock(side_effect=FakeVLLM().respond)
        twin, traces = twin_with_traces(
            mode, prefill_base_url=[p1, p2], routing="round_robin", breaker=BreakerSettings(failures=2, cooldown=30)
        )
        clock = FakeClock()
        for pool in (twin.client.pd_fleet.prefill, twin.client.pd_fleet.decode):
            pool.clock = clock
            for endpoint in pool.endpoints:
                endpoint._clock = clock
        for _ in range(6):
            await twin.chat(messages=MESSAGES)
        p1_endpoint = twin.client.pd_fleet.prefill.endpoints[0]
        assert p1_endpoint.state == "open"
        assert bad.call_count == 2, "opened after two failures, then skipped"
        assert all(t.prefill_url == p2 and t.fallback is None for t in traces), "the retry went to p2 each time"
        clock.now += 31
        assert p1_endpoint.state == "half-open"
        bad.mock(side_effect=lambda r: httpx.Response(200, json=prefill_json(json.loads(r.content))))
        for _ in range(2):
            await twin.chat(messages=MESSAGES)
        assert p1_endpoint.state == "closed" and bad.call_count == 3
        assert good.call_count >= 6


async def test_every_endpoint_open_is_a_clear_error_naming_them(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["decode"].mock(side_effect=httpx.ConnectError("down"))
    twin, traces = twin_with_traces(mode, breaker=BreakerSettings(failures=1, cooldown=60))
    for _ in range(2):
        with pytest.raises(openai.InternalServerError) as excinfo:
            await twin.chat(messages=MESSAGES)
        error = status_error(excinfo)
        assert error.status_code == 503
        assert f"every decode endpoint has its circuit breaker open: {DECODE} (open)" in str(error)
    assert pd_routes["decode"].call_count == 1, "the first failure opened the breaker; no second connect"
    assert traces[-1].error is not None and "every decode endpoint" in traces[-1].error


async def test_every_prefill_endpoint_open_follows_the_failure_policy(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["prefill"].mock(side_effect=httpx.ConnectError("down"))
    twin, traces = twin_with_traces(mode, breaker=BreakerSettings(failures=1, cooldown=60))
    await twin.chat(messages=MESSAGES)
    await twin.chat(messages=MESSAGES)
    assert pd_routes["prefill"].call_count == 1, "the open breaker stops further prefill attempts"
    assert traces[1].fallback is not None
    assert "every prefill endpoint has its circuit breaker open" in traces[1].fallback


async def test_worst_case_attempts_per_call(mode: str, pd_routes: respx.MockRouter) -> None:
    """(max_retries + 1) * (prefill_attempts + decode_attempts), as _retry documents."""
    pd_routes["prefill"].mock(return_value=httpx.Response(503, text="busy"))
    pd_routes["decode"].mock(side_effect=httpx.ConnectError("refused"))
    twin, _ = twin_with_traces(mode, max_retries=2, breaker=BreakerSettings(failures=1000))
    with pytest.raises(openai.APIConnectionError):
        await twin.chat(messages=MESSAGES)
    assert pd_routes["prefill"].call_count == 3 * 3
    assert pd_routes["decode"].call_count == 3 * 2
    assert pd_routes["prefill"].call_count + pd_routes["decode"].call_count == 15


async def test_affinity_keeps_a_conversation_on_the_same_servers(mode: str) -> None:
    prefills = [f"http://p{i}.test/v1" for i in range(4)]
    decodes = [f"http://d{i}.test/v1" for i in range(4)]
    with respx.mock(assert_all_called=False) as router:
        for url in prefills:
            router.post(f"{url}/chat/completions").mock(
                side_effect=lambda r: httpx.Response(200, json=prefill_json(json.loads(r.content)))
            )
        for url in decodes:
            router.post(f"{url}/chat/completions").mock(side_effect=FakeVLLM().respond)
        twin, traces = twin_with_traces(mode, prefill_base_url=prefills, decode_base_url=decodes, routing="affinity")
        for conversation in range(8):
            history = [{"role": "system", "content": "s"}, {"role": "user", "content": f"topic {conversation}"}]
            for turn in range(3):
                await twin.chat(messages=history)
                history += [{"role": "assistant", "content": "a"}, {"role": "user", "content": f"more {turn}"}]
        by_conversation = [traces[i * 3 : i * 3 + 3] for i in range(8)]
        for turns in by_conversation:
            assert len({(t.prefill_url, t.decode_url) for t in turns}) == 1
        assert len({turns[0].prefill_url for turns in by_conversation}) > 1, "conversations spread over servers"
        await twin.chat(messages=MESSAGES, extra_body={"pdclient": {"session": "user-42"}})
        await twin.chat(
            messages=[{"role": "user", "content": "other"}], extra_body={"pdclient": {"session": "user-42"}}
        )
        assert traces[-1].prefill_url == traces[-2].prefill_url and traces[-1].decode_url == traces[-2].decode_url


async def test_stream_closed_early_closes_decode_and_frees_the_endpoint(mode: str, pd_routes: respx.MockRouter) -> None:
    twin, traces = twin_with_traces(mode)
    stream = await twin.chat(messages=MESSAGES, stream=True)
    if mode == "sync":
        next(iter(stream))
        stream.close()
    else:
        await stream.__anext__()
        await stream.close()
    assert in_flight(twin) == [0, 0] and len(traces) == 1


async def test_cancel_between_legs_releases_prefill_kv_async(pd_routes: respx.MockRouter) -> None:
    decode_started = asyncio.Event()
    calls: list[dict[str, Any]] = []

    async def slow_decode(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        if len(calls) == 1:
            decode_started.set()
            await asyncio.sleep(30)
        return httpx.Response(200, json=chat_json("released"))

    pd_routes["decode"].mock(side_effect=slow_decode)
    twin, traces = twin_with_traces("async")
    task = asyncio.create_task(twin.chat(messages=MESSAGES, stream=True))
    await asyncio.wait_for(decode_started.wait(), 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await until(lambda: len(calls) == 2)
    release = calls[1]
    assert release["max_tokens"] == 1 and release["stream"] is False and "stream_options" not in release
    assert release["kv_transfer_params"] == {**NIXL_PARAMS, "prompt_token_ids": ids_for("Is it up?")}
    assert traces[0].outcome is Outcome.FAILED and traces[0].error == "CancelledError"
    assert in_flight(twin) == [0, 0]


def test_interrupt_between_legs_releases_prefill_kv_sync(pd_routes: respx.MockRouter) -> None:
    calls: list[dict[str, Any]] = []

    def interrupted_decode(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        if len(calls) == 1:
            raise KeyboardInterrupt
        return httpx.Response(200, json=chat_json("released"))

    pd_routes["decode"].mock(side_effect=interrupted_decode)
    twin, _ = twin_with_traces("sync")
    with pytest.raises(KeyboardInterrupt):
        twin.client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[call-overload]
    deadline = time.monotonic() + 5
    while len(calls) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls[1]["max_tokens"] == 1 and calls[1]["kv_transfer_params"]["remote_block_ids"] == [3, 4]


async def test_a_prefill_that_answers_a_redirect_failed(mode: str, pd_routes: respx.MockRouter) -> None:
    """A 3xx is no prefill: the leg failed (no retry, the failure policy decides), and its
    Location, which names a server, never reaches the caller."""
    redirect = httpx.Response(307, headers={"location": "http://prefill.internal:8100/v1/chat/completions"})
    pd_routes["prefill"].mock(return_value=redirect)
    twin, traces = twin_with_traces(mode)
    answer = await twin.chat(messages=MESSAGES)
    assert answer.choices[0].message.content == ANSWER and pd_routes["prefill"].call_count == 1
    trace = traces[0]
    assert trace.outcome is Outcome.PREFILL_FAILED and trace.forwarded_tokens == 0
    assert trace.fallback is not None and "redirect (HTTP 307)" in trace.fallback
    assert "kv_transfer_params" not in json.loads(pd_routes["decode"].calls[0].request.content)
    with pytest.raises(openai.APIStatusError) as excinfo:
        await twin.chat(messages=MESSAGES, extra_body={"pdclient": {"on_prefill_failure": "fail"}})
    error = status_error(excinfo)
    assert error.status_code == 502 and error.response.headers["x-pd-failed-leg"] == "prefill"
    assert "location" not in error.response.headers and "redirect (HTTP 307)" in str(error)
    assert traces[1].outcome is Outcome.FAILED and traces[1].failed_leg == "prefill"
