"""The proxy's aiohttp leg transport keeps httpx's contract: the errors, the body as it
arrives (up to a cut), the trace event the core's KV-release decision reads."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import httpx
import pytest

from pdclient.serve._legs import AiohttpTransport
from pdclient.transport import IDLE_CONNECTION_SECONDS, LEG_LIMITS
from tests.stubserver import Fault, StubServer, closed_port_url, forward_proxy

from .conftest import MESSAGES

CHAT = {"model": "m", "messages": MESSAGES}


async def send(url: str, body: Any = None, timeout: float = 5, **trace: Any) -> tuple[httpx.Response, bytes, list[str]]:
    events: list[str] = []

    async def watch(event: str, info: object) -> None:
        events.append(event)

    transport = AiohttpTransport()
    content = None if body is None else json.dumps(body).encode()
    request = httpx.Request(
        "GET" if body is None else "POST",
        url,
        content=content,
        headers={"content-type": "application/json"} if body is not None else {},
        extensions={
            "timeout": {"connect": timeout, "read": timeout, "write": timeout, "pool": timeout},
            "trace": watch,
        },
    )
    try:
        response = await transport.handle_async_request(request)
        chunks = []
        try:
            async for chunk in response.stream:  # type: ignore[union-attr]
                chunks.append(chunk)
        finally:
            await response.aclose()
        return response, b"".join(chunks), events
    finally:
        await transport.aclose()


async def test_answers_streams_and_reports_the_request_going_out(stub: StubServer) -> None:
    response, body, events = await send(stub.url + "/chat/completions", {**CHAT, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"] == "text/event-stream"
    assert body.endswith(b"data: [DONE]\n\n")
    assert events == ["http11.send_request_headers.started"]
    models, listed, _ = await send(stub.url + "/models")  # a GET: no body sent
    assert models.status_code == 200 and json.loads(listed)["data"][0]["id"] == "stub-model"
    assert stub.received[0].body == {**CHAT, "stream": True} and stub.received[1].body is None


async def test_a_refused_connection_is_a_connect_error_with_nothing_sent() -> None:
    with pytest.raises(httpx.ConnectError):
        await send(closed_port_url() + "/models")


async def test_a_slow_answer_is_a_read_timeout(stub: StubServer) -> None:
    stub.inject(Fault(delay=1.0))
    with pytest.raises(httpx.ReadTimeout):
        await send(stub.url + "/chat/completions", CHAT, timeout=0.2)


async def test_a_stream_that_stops_mid_way_is_a_read_timeout_after_what_arrived(stub: StubServer) -> None:
    gate = threading.Semaphore(0)  # released once: the stub sends a second event, then holds the third
    stub.inject(Fault(event_gate=gate), leg="decode")
    transport = AiohttpTransport()
    request = httpx.Request("POST", stub.url + "/chat/completions", json={**CHAT, "stream": True})
    request.extensions["timeout"] = {"connect": 5, "read": 0.3, "write": 5, "pool": 5}
    response = await transport.handle_async_request(request)
    received = b""
    started = time.monotonic()
    try:
        with pytest.raises(httpx.ReadTimeout):
            async for chunk in response.stream:  # type: ignore[union-attr]
                if not received:
                    gate.release()
                received += chunk
    finally:
        await response.aclose()
        await transport.aclose()
    assert received.count(b"data: ") == 2 and 0.3 <= time.monotonic() - started < 5


async def test_the_read_timeout_bounds_each_wait_not_the_whole_body(stub: StubServer) -> None:
    """Events 0.3 s apart under a 1 s read timeout: the body takes longer than the timeout, no wait does."""
    stub.inject(Fault(event_delay=0.3), leg="decode")
    started = time.monotonic()
    response, body, _ = await send(stub.url + "/chat/completions", {**CHAT, "stream": True}, timeout=1.0)
    assert response.status_code == 200 and body.endswith(b"data: [DONE]\n\n")
    assert time.monotonic() - started > 1.0


async def test_a_caller_slow_to_read_on_is_not_the_server_timing_out(stub: StubServer) -> None:
    """The answer is all sent; the caller waits past the read timeout before reading it: it
    gets all of it, and once the body is closed no timer is left behind."""
    transport = AiohttpTransport()
    request = httpx.Request("POST", stub.url + "/chat/completions", json={**CHAT, "stream": True})
    request.extensions["timeout"] = {"connect": 5, "read": 0.2, "write": 5, "pool": 5}
    response = await transport.handle_async_request(request)
    chunks = aiter(response.stream)  # type: ignore[arg-type]
    received = await anext(chunks)
    await asyncio.sleep(0.6)
    async for chunk in chunks:
        received += chunk
    await response.aclose()
    await transport.aclose()
    assert received.endswith(b"data: [DONE]\n\n")
    deadline = response.stream._deadline  # type: ignore[union-attr]
    assert deadline is None or deadline._timer is None


async def test_a_connection_dropped_before_the_answer_is_a_protocol_error(stub: StubServer) -> None:
    stub.inject(Fault(drop=True))
    with pytest.raises(httpx.RemoteProtocolError):
        await send(stub.url + "/chat/completions", CHAT)


async def test_a_cut_body_delivers_what_arrived_then_raises(stub: StubServer) -> None:
    stub.inject(Fault(drop_after_events=2), leg="decode")
    transport = AiohttpTransport()
    request = httpx.Request("POST", stub.url + "/chat/completions", json={**CHAT, "stream": True})
    response = await transport.handle_async_request(request)
    received = b""
    with pytest.raises(httpx.RemoteProtocolError):
        async for chunk in response.stream:  # type: ignore[union-attr]
            received += chunk
    await response.aclose()
    await transport.aclose()
    assert received.count(b"data: ") == 2


async def test_idle_connections_are_let_go_before_vllm_closes_them(stub: StubServer) -> None:
    """vLLM's server closes an idle connection after 5 s; a leg sent on one just as it closes
    fails, and a decode leg is not sent again: both leg clients let go of theirs sooner."""
    assert IDLE_CONNECTION_SECONDS < 5 and LEG_LIMITS.keepalive_expiry == IDLE_CONNECTION_SECONDS
    transport = AiohttpTransport()
    try:
        response = await transport.handle_async_request(httpx.Request("GET", stub.url + "/models"))
        await response.aread()
        assert transport._connector is not None
        assert transport._connector._keepalive_timeout == IDLE_CONNECTION_SECONDS
    finally:
        await transport.aclose()


async def test_legs_honour_http_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """As the clients' legs do (issue 13, item 16): the proxy's own legs go through HTTP_PROXY."""
    with forward_proxy(monkeypatch) as seen:
        response, body, _ = await send("http://decode.invalid/v1/chat/completions", CHAT)
        assert response.status_code == 200 and json.loads(body)["choices"][0]["message"]["content"] == "via proxy"
        assert seen == ["http://decode.invalid/v1/chat/completions"]


async def test_background_fetches_go_straight_on_the_legs_transport_and_leave_it_open(stub: StubServer) -> None:
    """Warm-ups, probes and scrapes of ``pdclient serve`` (``TransportClient``): the answer and
    the whole-answer deadline as through a client, and the legs' transport open after."""
    from pdclient.fleet._background import Fetch, Fetched, TransportClient, fetch

    transport = AiohttpTransport()
    body = json.dumps({**CHAT, "max_tokens": 1}).encode()
    headers = (("content-type", "application/json"), ("x-request-id", "r-warm-up"))
    try:
        async with TransportClient(transport) as http:
            warmed = await fetch(http, Fetch(stub.url + "/chat/completions", 5.0, None, body, headers))
            stub.inject(Fault(delay=1.0))
            started = time.monotonic()
            late = await fetch(http, Fetch(stub.url + "/chat/completions", 0.3, None, body, headers))
        assert warmed.ok and json.loads(warmed.text)["usage"]["completion_tokens"] >= 1
        assert late == Fetched(None, error="TimeoutError: no whole answer within 0.3 s")
        assert time.monotonic() - started < 1.0
        # Still open for the legs: a request on it after the background's client closed.
        request = httpx.Request("GET", stub.url + "/models", extensions={"timeout": dict.fromkeys(TIMEOUTS, 5)})
        response = await transport.handle_async_request(request)
        assert response.status_code == 200 and b'"data"' in await response.aread()
        await response.aclose()
    finally:
        await transport.aclose()


TIMEOUTS = ("connect", "read", "write", "pool")
