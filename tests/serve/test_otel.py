"""OpenTelemetry in the proxy, from the standard ``OTEL_*`` environment (``--otel auto``)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from pdclient.otel import OTelObserver
from pdclient.serve import create_app
from pdclient.serve._telemetry import tracing_requested
from tests.stubserver import StubServer

from .conftest import MESSAGES, ServeProcess, config_for

pytest.importorskip("opentelemetry.sdk", reason="opentelemetry-sdk is not installed")

CHAT = {"model": "m", "messages": MESSAGES}
CONSOLE = {
    "OTEL_TRACES_EXPORTER": "console",
    "OTEL_SERVICE_NAME": "pdclient-proxy-test",
    "OTEL_BSP_SCHEDULE_DELAY": "50",
}


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer(prompt_tokens=32) as server:
        yield server


def spans(lines: list[str]) -> list[dict]:
    """The console exporter's spans: one JSON object each, over several lines."""
    found, current = [], []
    for line in lines:
        current.append(line)
        if line == "}":
            found.append(json.loads("\n".join(current)))
            current = []
    return found


def test_a_proxied_call_produces_spans_from_the_otel_environment(stub: StubServer) -> None:
    serve = ServeProcess("--prefill", stub.url, "--decode", stub.url, env=CONSOLE)
    try:
        assert httpx.post(serve.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
    finally:
        serve.stop()  # the lifespan's end flushes the spans
    recorded = spans(serve.out_lines)
    names = {span["name"] for span in recorded}
    assert {"pdclient.chat", "pdclient.prefill", "pdclient.decode"} <= names, serve.out_lines
    (chat,) = [span for span in recorded if span["name"] == "pdclient.chat"]
    assert chat["attributes"]["pdclient.outcome"] == "disaggregated"
    assert chat["resource"]["attributes"]["service.name"] == "pdclient-proxy-test"
    assert "otel=on" in serve.stderr()


def test_otel_off_records_nothing(stub: StubServer) -> None:
    serve = ServeProcess("--prefill", stub.url, "--decode", stub.url, "--otel", "off", env=CONSOLE)
    try:
        assert httpx.post(serve.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
    finally:
        serve.stop()
    assert spans(serve.out_lines) == []


@pytest.mark.parametrize(
    ("environ", "requested"),
    [
        ({}, False),
        ({"OTEL_SERVICE_NAME": "x"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_SDK_DISABLED": "true"}, False),
    ],
)
def test_auto_follows_the_otel_environment(environ: dict[str, str], requested: bool) -> None:
    assert tracing_requested(environ) is requested


def test_the_observer_is_added_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_TRACES_EXPORTER", "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)

    def observers(**settings: object) -> list[object]:
        app = create_app(config_for("http://127.0.0.1:9/v1", **settings))
        return [o for o in app.state.proxy.transport.options.observers if isinstance(o, OTelObserver)]

    assert observers() == []  # auto, and nothing in the environment asks for traces
    assert len(observers(otel="on")) == 1
