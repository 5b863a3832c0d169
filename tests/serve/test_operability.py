"""What an operator relies on: /ready honest from the start and at shutdown, a startup line
that says what runs (and no secret), one log line per call."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

import pdclient
from pdclient.fleet import HealthSettings
from pdclient.serve import create_app
from tests.stubserver import Fault, StubServer, closed_port_url

from .conftest import MESSAGES, ServeProcess, config_for, running_proxy

CHAT = {"model": "m", "messages": MESSAGES}


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer(prompt_tokens=32) as server:
        yield server


def ready_status(url: str) -> int | None:
    """``/ready``'s status, or None when the connection is refused or closed unanswered."""
    try:
        return httpx.get(url + "/ready", timeout=2).status_code
    except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout):
        return None


# -- /ready before any traffic -------------------------------------------------------------


def test_ready_is_503_before_any_call_when_the_only_decode_endpoint_is_dead(stub: StubServer) -> None:
    """The health checks start with the app: a dead decode endpoint makes the proxy unready
    within one probe (interval + timeout), no call needed."""
    settings = HealthSettings()
    serve = ServeProcess("--prefill", stub.url, "--decode", closed_port_url(), "--health-checks", "on")
    try:
        started = time.monotonic()
        statuses = []
        while time.monotonic() - started < settings.interval + settings.timeout:
            statuses.append(ready_status(serve.url))
            if statuses[-1] == 503:
                break
            time.sleep(0.1)
        assert statuses[-1] == 503, statuses
        # The first probes are in before the listener opens: /ready never said 200.
        assert 200 not in statuses, statuses
        body = httpx.get(serve.url + "/ready", timeout=2).json()
        assert body["ready"] is False and body["decode"][0]["probe"] == "failing"
        assert [r.path for r in stub.received] == ["/health"] * len(stub.received)  # probes, no call
    finally:
        serve.stop()


async def test_ready_follows_the_health_checks_from_the_start(stub: StubServer) -> None:
    """A live pool is ready from the first /ready; a server whose /health fails makes it
    unready at its next probe, before its breaker opens (three probes), and ready again
    once it passes."""
    settings = HealthSettings(interval=0.2, timeout=1.0)
    config = config_for(stub.url)
    config = dataclasses.replace(config, options=config.options.replace(health_checks=settings))
    with running_proxy(config) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            first = await http.get("/ready")
            assert first.status_code == 200, first.text
            assert first.json()["decode"][0]["probe"] == "ok"
            stub.healthy = False
            deadline = time.monotonic() + settings.interval + settings.timeout + 1
            while (answer := await http.get("/ready")).status_code == 200:
                assert time.monotonic() < deadline, "/ready still 200 after a failed probe"
                await asyncio.sleep(0.02)
            assert answer.status_code == 503 and answer.json()["decode"][0]["probe"] == "failing"
            stub.healthy = True
            deadline = time.monotonic() + 5
            while (answer := await http.get("/ready")).status_code != 200:
                assert time.monotonic() < deadline, answer.text
                await asyncio.sleep(0.02)
    assert {r.path for r in stub.received} == {"/health"}  # probes, no call


# -- /ready on SIGTERM ---------------------------------------------------------------------


def test_ready_turns_503_on_sigterm_while_a_stream_finishes(stub: StubServer) -> None:
    stub.inject(Fault(event_delay=0.4), leg="decode")  # 7 events: ~2.4 s
    serve = ServeProcess("--prefill", stub.url, "--decode", stub.url, "--grace-period", "20")
    try:
        assert ready_status(serve.url) == 200
        with (
            httpx.Client(timeout=10) as http,
            http.stream("POST", serve.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as response,
        ):
            lines = response.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            serve.proc.send_signal(signal.SIGTERM)
            # A new connection during the shutdown may be refused; one that is answered is a 503.
            statuses = [ready_status(serve.url) for _ in range(20)]
            assert set(statuses) <= {503, None}, statuses
            events += [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) == 7
        serve.proc.wait(10)
    finally:
        serve.stop()


async def test_ready_turns_503_at_the_signal_and_the_server_still_gets_it() -> None:
    """In the app: the shutdown signal flips readiness at once, then reaches the handler the
    server installed (uvicorn's, which starts the graceful shutdown)."""
    app = create_app(config_for("http://127.0.0.1:9/v1"))
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda sig, frame: received.append(sig))
    try:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
                assert (await http.get("/ready")).status_code == 200
                signal.raise_signal(signal.SIGTERM)
                answer = await http.get("/ready")
            assert answer.status_code == 503 and answer.json()["draining"] is True
            assert received == [signal.SIGTERM]
        assert len(received) == 1
    finally:
        signal.signal(signal.SIGTERM, previous)


# -- the startup line ----------------------------------------------------------------------


async def test_one_startup_line_says_what_runs_and_no_secret(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdclient.serve")
    prefill = "http://user:url-pass-1@127.0.0.1:9/v1"
    settings: dict[str, Any] = {
        "api_keys": ("caller-key-1", "caller-key-2"),
        "upstream_api_key": "upstream-key-1",
        "reuse_secret": "reuse-secret-1",
        "trace_headers": True,
        "tenant_header": "X-Tenant",
        "status_requires_api_key": True,
        "decode_routing": "load_aware",
        "health_checks": True,
        "remote_prefill": "always",
    }
    config = config_for(prefill, ["http://127.0.0.1:10/v1", "http://127.0.0.1:11/v1"], **settings)
    with running_proxy(config):
        pass
    lines = [
        r.getMessage() for r in caplog.records if r.name == "pdclient.serve" and "pdclient serve" in r.getMessage()
    ]
    assert len(lines) == 1, lines
    (line,) = lines
    assert f"pdclient serve {pdclient.__version__}" in line
    assert "prefill=[http://***@127.0.0.1:9/v1]" in line
    assert "decode=[http://127.0.0.1:10/v1,http://127.0.0.1:11/v1]" in line
    assert "prefill_routing=least_outstanding" in line and "decode_routing=load_aware" in line
    assert "health_checks=on" in line and "discovery=off" in line and "load_signals=decode" in line
    assert "remote_prefill=always" in line and "max_decode_migrations=1" in line
    assert "api_keys=2" in line and "upstream_api_key=set" in line and "signed_legs=on" in line
    assert "trace_headers=on" in line and "tenant_header=X-Tenant" in line and "status_requires_api_key=on" in line
    for secret in ("caller-key", "upstream-key-1", "reuse-secret-1", "url-pass-1"):
        assert secret not in line


# -- one log line per call -----------------------------------------------------------------


def test_a_degraded_refused_or_failed_call_logs_one_line(stub: StubServer) -> None:
    """In the proxy the call line (outcome, fallback, error) is the only line a call logs:
    not also the library's warning or the proxy's own."""
    serve = ServeProcess("--prefill", closed_port_url(), "--decode", stub.url, "--prefill-attempts", "1")
    try:
        degraded = httpx.post(serve.url + "/v1/chat/completions", json=CHAT, headers={"x-request-id": "degraded-1"})
        assert degraded.status_code == 200
        refused = httpx.post(
            serve.url + "/v1/chat/completions",
            json={**CHAT, "kv_transfer_params": {}},
            headers={"x-request-id": "refused-1"},
        )
        assert refused.status_code == 400
        stub.inject(Fault(drop=True), leg="decode")
        failed = httpx.post(
            serve.url + "/v1/completions", json={"model": "m", "prompt": "hi"}, headers={"x-request-id": "failed-1"}
        )
        assert failed.status_code == 502
        time.sleep(0.2)
    finally:
        serve.stop()
    for request_id, outcome in (("degraded-1", "prefill_failed"), ("refused-1", "refused"), ("failed-1", "failed")):
        lines = [line for line in serve.lines if request_id in line]
        assert len(lines) == 1, "\n".join(lines)
        assert re.search(rf"INFO pdclient\.serve \[\d+\]: call .*outcome={outcome}", lines[0]), lines[0]
        assert ("fallback=" if outcome == "prefill_failed" else "error=") in lines[0]
