"""The observer contract of pdclient/_observe.py, as the proxy's calls deliver it.

Every on_call_start is followed by exactly one on_call_end, every on_leg_start by exactly
one on_leg_end, on every path: a stream, a pass-through, a refusal, a failed prefill, a
caller leaving mid-stream or between the legs. The transport fires them; the proxy's own
observers (metrics, the log line) sit beside the test's in ``PDOptions.observers``.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdclient import CallView, LegView, PDObserver, PDTrace
from tests.polling import until
from tests.stubserver import Fault, StubServer, closed_port_url

from .conftest import MESSAGES, RunningProxy, config_for, running_proxy

CHAT = {"model": "m", "messages": MESSAGES}


class Recorder(PDObserver):
    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.lock = threading.Lock()

    def _add(self, *event: Any) -> None:
        with self.lock:
            self.events.append(event)

    def on_call_start(self, call: CallView) -> None:
        self._add("call_start", call.request_id, call.route)

    def on_leg_start(self, call: CallView, leg: LegView) -> None:
        self._add("leg_start", call.request_id, leg.name, leg.attempt)

    def on_leg_end(self, call: CallView, leg: LegView, status: int | None, error: BaseException | None) -> None:
        self._add("leg_end", call.request_id, leg.name, status if error is None else type(error).__name__)

    def on_first_byte(self, call: CallView) -> None:
        self._add("first_byte", call.request_id)

    def on_call_end(self, call: CallView, trace: PDTrace) -> None:
        self._add("call_end", call.request_id, trace.request_id)

    def of(self, request_id: str) -> list[tuple[Any, ...]]:
        with self.lock:
            return [(e[0], *e[2:]) for e in self.events if e[1] == request_id]

    def check_contract(self) -> None:
        with self.lock:
            events = list(self.events)
        calls = {e[1] for e in events}
        for request_id in calls:
            mine = [e for e in events if e[1] == request_id]
            kinds = [e[0] for e in mine]
            assert kinds[0] == "call_start" and kinds.count("call_start") == 1, mine
            assert kinds.count("call_end") == 1, mine
            assert mine[kinds.index("call_end")][2] == request_id, "the trace is the call's"
            assert kinds.count("leg_start") == kinds.count("leg_end"), mine
            assert kinds.count("first_byte") <= 1, mine


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    recorder = Recorder()
    yield recorder
    recorder.check_contract()


@pytest.fixture
def observed(stub: StubServer, recorder: Recorder) -> Iterator[RunningProxy]:
    with running_proxy(config_for(stub.url, observers=[recorder])) as proxy:
        yield proxy


async def test_stream_passthrough_and_refusal(observed: RunningProxy, recorder: Recorder) -> None:
    async with httpx.AsyncClient(base_url=observed.base_url) as http:
        await http.post("/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "s"})
        await http.get("/models", headers={"x-request-id": "p"})
        refused = {**CHAT, "kv_transfer_params": {}}
        assert (await http.post("/chat/completions", json=refused, headers={"x-request-id": "r"})).status_code == 400
    assert recorder.of("s") == [
        ("call_start", "chat"),
        ("leg_start", "prefill", 1),
        ("leg_end", "prefill", 200),
        ("leg_start", "decode", 1),
        ("first_byte",),
        ("leg_end", "decode", 200),
        ("call_end", "s"),
    ]
    assert recorder.of("p") == [
        ("call_start", "passthrough"),
        ("leg_start", "decode", 1),
        ("first_byte",),
        ("leg_end", "decode", 200),
        ("call_end", "p"),
    ]
    assert recorder.of("r") == [("call_start", "chat"), ("call_end", "r")]


async def test_prefill_retried_then_decode_only(stub: StubServer, recorder: Recorder) -> None:
    stub.inject(Fault(status=503), leg="prefill", times=3)
    with running_proxy(config_for(stub.url, observers=[recorder])) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            response = await http.post("/chat/completions", json=CHAT, headers={"x-request-id": "f"})
    assert response.status_code == 200
    legs = [e for e in recorder.of("f") if e[0].startswith("leg")]
    assert legs == [
        *[e for n in (1, 2, 3) for e in (("leg_start", "prefill", n), ("leg_end", "prefill", 503))],
        ("leg_start", "decode", 1),
        ("leg_end", "decode", 200),
    ]
    recorder.check_contract()


async def test_unreachable_prefill_legs_end_with_the_error(recorder: Recorder, stub: StubServer) -> None:
    with running_proxy(config_for(closed_port_url(), stub.url, observers=[recorder])) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            await http.post("/chat/completions", json=CHAT, headers={"x-request-id": "u"})
    assert ("leg_end", "prefill", "ConnectError") in recorder.of("u")


async def test_caller_leaving_mid_stream_and_before_the_decode_answers(stub: StubServer, recorder: Recorder) -> None:
    stub.inject(Fault(event_gate=threading.Semaphore(0)), leg="decode")
    with running_proxy(config_for(stub.url, observers=[recorder])) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url, timeout=5) as http:
            body = {**CHAT, "stream": True}
            async with http.stream("POST", "/chat/completions", json=body, headers={"x-request-id": "m"}) as r:
                async for _ in r.aiter_lines():
                    break
        await until(lambda: ("call_end", "m") in recorder.of("m"), what="the call to end")
        stub.inject(Fault(delay=1.0), leg="decode")
        async with httpx.AsyncClient(base_url=proxy.base_url, timeout=httpx.Timeout(5, read=0.3)) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post("/chat/completions", json=CHAT, headers={"x-request-id": "b"})
        await until(lambda: ("call_end", "b") in recorder.of("b"), what="the call to end")
        await asyncio.sleep(0.1)
    assert ("leg_end", "decode", 200) in recorder.of("m")
    assert recorder.of("b") == [
        ("call_start", "chat"),
        ("leg_start", "prefill", 1),
        ("leg_end", "prefill", 200),
        ("leg_start", "decode", 1),
        ("leg_end", "decode", "CancelledError"),  # the caller's leaving cancelled it
        # No release leg: the decode request had reached its server, which frees the prefill's
        # KV itself when the request is aborted (vLLM 0.27+; tests/pair/test_serve.py shows it).
        ("call_end", "b"),
    ]


async def test_decode_unreachable_after_the_prefill_releases_its_kv(stub: StubServer, recorder: Recorder) -> None:
    """The first decode endpoint refuses the connection (its breaker opens at once); the
    release, a one-token decode pulling the prefill's blocks, goes to the other one."""
    decode = [closed_port_url(), stub.url]
    # Least outstanding with ties takes the first endpoint (rendezvous would pick by the ports' hash).
    config = config_for(
        stub.url,
        decode,
        observers=[recorder],
        decode_attempts=1,
        breaker_failures=1,
        decode_routing="least_outstanding",
    )
    with running_proxy(config) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            response = await http.post("/chat/completions", json=CHAT, headers={"x-request-id": "u"})
    assert response.status_code == 502
    assert recorder.of("u") == [
        ("call_start", "chat"),
        ("leg_start", "prefill", 1),
        ("leg_end", "prefill", 200),
        ("leg_start", "decode", 1),
        ("leg_end", "decode", "ConnectError"),
        ("leg_start", "release", 1),
        ("leg_end", "release", 200),
        ("call_end", "u"),
    ]
    (release,) = stub.legs("decode")
    assert release.body["max_tokens"] == 1 and release.body["stream"] is False
    assert release.body["kv_transfer_params"]["remote_engine_id"] == "stub-prefill-engine-0"
    (prefill,) = stub.legs("prefill")
    assert release.headers["x-request-id"] == prefill.headers["x-request-id"] != "u"  # the legs' id
