"""PrometheusObserver: events fired by hand (as the transports fire them), then what a
scrape shows; and the proxy's /metrics after real calls, read with prometheus_client's parser."""

from __future__ import annotations

import platform
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest

prometheus_client = pytest.importorskip("prometheus_client", reason="pdclient[prometheus] is not installed")

from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402

import pdclient  # noqa: E402
from pdclient import AsyncPDTransport, Outcome, PDTrace  # noqa: E402
from pdclient.metrics import EndpointState, PrometheusObserver  # noqa: E402
from tests.stubserver import StubServer  # noqa: E402

from .conftest import MESSAGES, PROMPT_TOKENS, RunningProxy, metric_samples  # noqa: E402

P, D = "http://p:8100/v1", "http://d:8200/v1"


@dataclass
class Call:
    request_id: str = "r1"
    route: str = "chat"
    request: httpx.Request = field(default_factory=lambda: httpx.Request("POST", D + "/chat/completions"))
    started: float = field(default_factory=time.perf_counter)
    data: MutableMapping[Any, Any] = field(default_factory=dict)


@dataclass
class Leg:
    name: str
    url: str
    attempt: int = 1
    request: httpx.Request = field(default_factory=lambda: httpx.Request("POST", P + "/chat/completions"))
    sent_at: float = field(default_factory=time.perf_counter)


def scrape(registry: CollectorRegistry) -> dict[Any, float]:
    return metric_samples(generate_latest(registry).decode())


def one_call(observer: PrometheusObserver, trace: PDTrace, *, prefill_status: int | None = 200) -> None:
    call = Call(route=trace.route)
    observer.on_call_start(call)
    if prefill_status is not None:
        leg = Leg("prefill", P)
        observer.on_leg_start(call, leg)
        observer.on_leg_end(call, leg, prefill_status, None)
    decode = Leg("decode", D)
    observer.on_leg_start(call, decode)
    observer.on_first_byte(call)
    observer.on_leg_end(call, decode, 200, None)
    observer.on_call_end(call, trace)


def test_events_become_metrics() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    one_call(observer, PDTrace(request_id="a", route="chat", forwarded_tokens=500))
    one_call(observer, PDTrace(request_id="b", route="chat", forwarded_tokens=300))
    degraded = PDTrace(request_id="c", route="chat", outcome=Outcome.PREFILL_FAILED, fallback="prefill failed, ...")
    one_call(observer, degraded, prefill_status=None)
    samples = scrape(registry)
    chat = (("route", "chat"),)
    assert samples[("pdclient_calls_total", (("outcome", "disaggregated"), *chat))] == 2
    assert samples[("pdclient_calls_total", (("outcome", "prefill_failed"), *chat))] == 1
    assert samples[("pdclient_forwarded_tokens_total", chat)] == 800
    assert samples[("pdclient_calls_in_flight", chat)] == 0
    assert samples[("pdclient_time_to_first_token_seconds_count", chat)] == 3
    assert samples[("pdclient_call_duration_seconds_count", chat)] == 3
    prefill = (("endpoint", P), ("leg", "prefill"), ("status", "200"))
    assert samples[("pdclient_leg_duration_seconds_count", prefill)] == 2
    decode = (("endpoint", D), ("leg", "decode"), ("status", "200"))
    assert samples[("pdclient_leg_duration_seconds_count", decode)] == 3


def test_in_flight_and_failed_legs() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    call = Call()
    observer.on_call_start(call)
    leg = Leg("prefill", P)
    observer.on_leg_start(call, leg)
    observer.on_leg_end(call, leg, None, httpx.ConnectError("refused"))
    samples = scrape(registry)
    assert samples[("pdclient_calls_in_flight", (("route", "chat"),))] == 1
    error = (("endpoint", P), ("leg", "prefill"), ("status", "error"))
    assert samples[("pdclient_leg_duration_seconds_count", error)] == 1


def test_registries_are_independent_and_namespaced() -> None:
    first, second = CollectorRegistry(), CollectorRegistry()
    a, b = PrometheusObserver(first), PrometheusObserver(second, namespace="proxy")
    one_call(a, PDTrace(request_id="a", route="chat"))
    assert ("pdclient_calls_total", (("outcome", "disaggregated"), ("route", "chat"))) in scrape(first)
    assert all(name.startswith("proxy_") for name, _ in scrape(second))
    assert b.registry is second
    with pytest.raises(ValueError, match="Duplicated"):
        PrometheusObserver(first)  # one observer per registry and namespace


def test_watch_exports_breaker_state_per_endpoint() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    transport = AsyncPDTransport(P, [D, "http://d2:8200/v1"])
    observer.watch(transport)
    samples = scrape(registry)
    assert samples[("pdclient_endpoint_state", (("endpoint", P), ("leg", "prefill"), ("state", "closed")))] == 1
    assert samples[("pdclient_endpoint_state", (("endpoint", P), ("leg", "prefill"), ("state", "open")))] == 0
    for _ in range(3):  # three failures open the breaker
        transport.fleet.prefill.endpoints[0].acquire()
        transport.fleet.prefill.endpoints[0].release(ok=False)
    samples = scrape(registry)
    assert samples[("pdclient_endpoint_state", (("endpoint", P), ("leg", "prefill"), ("state", "open")))] == 1
    assert samples[("pdclient_endpoint_in_flight", (("endpoint", "http://d2:8200/v1"), ("leg", "decode")))] == 0
    observer.watch(lambda: [EndpointState("decode", "http://d3/v1", "half-open", True, 2)])
    samples = scrape(registry)
    assert samples[("pdclient_endpoint_in_flight", (("endpoint", "http://d3/v1"), ("leg", "decode")))] == 2


def test_watch_exports_the_lines_auto_decides_with() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    transport = AsyncPDTransport(P, [D, "http://user:secret@d2:8200/v1"])
    observer.watch(transport)
    observer.watch(transport)  # watched twice: each line still once
    handoff = (("endpoint", ""), ("line", "handoff"))
    samples = scrape(registry)
    assert (samples[("pdclient_cost_fixed_ms", handoff)], samples[("pdclient_cost_samples", handoff)]) == (266.0, 0)
    assert not [labels for name, labels in samples if name.startswith("pdclient_cost") and labels != handoff]
    for tokens in (100, 200, 300, 400, 500):
        transport.fleet.costs.decode_only("http://user:secret@d2:8200/v1", tokens, 30 + 2.0 * tokens)
    samples = scrape(registry)
    decode = (("endpoint", "http://***@d2:8200/v1"), ("line", "decode_prefill"))
    assert samples[("pdclient_cost_fixed_ms", decode)] == pytest.approx(30.0)
    assert samples[("pdclient_cost_ms_per_token", decode)] == pytest.approx(2.0)
    assert samples[("pdclient_cost_samples", decode)] == 5


async def test_proxy_metrics_after_calls(proxy: RunningProxy, stub: StubServer) -> None:
    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="-") as client:
        for _ in range(3):
            stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
            async for _chunk in stream:
                pass
        await client.chat.completions.create(model="m", messages=MESSAGES)
        await client.completions.create(model="m", prompt="Once", max_tokens=3)
        await client.models.list()
        with pytest.raises(openai.BadRequestError):
            await client.chat.completions.create(model="m", messages=MESSAGES, extra_body={"kv_transfer_params": {}})
    async with httpx.AsyncClient() as http:
        response = await http.get(proxy.url + "/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    samples = metric_samples(response.text)
    chat, completions, passthrough = (("route", "chat"),), (("route", "completions"),), (("route", "passthrough"),)
    assert samples[("pdclient_calls_total", (("outcome", "disaggregated"), *chat))] == 4
    assert samples[("pdclient_calls_total", (("outcome", "refused"), *chat))] == 1
    assert samples[("pdclient_calls_total", (("outcome", "disaggregated"), *completions))] == 1
    assert samples[("pdclient_calls_total", (("outcome", "passthrough"), *passthrough))] == 1
    assert samples[("pdclient_forwarded_tokens_total", chat)] == 4 * PROMPT_TOKENS
    assert samples[("pdclient_forwarded_tokens_total", completions)] == PROMPT_TOKENS
    assert samples[("pdclient_time_to_first_token_seconds_count", chat)] == 4
    for route in (chat, completions, passthrough):
        assert samples[("pdclient_calls_in_flight", route)] == 0
    prefill = (("endpoint", stub.url), ("leg", "prefill"), ("status", "200"))
    decode = (("endpoint", stub.url), ("leg", "decode"), ("status", "200"))
    assert samples[("pdclient_leg_duration_seconds_count", prefill)] == 5
    assert samples[("pdclient_leg_duration_seconds_count", decode)] == 6  # the models list is a decode leg too
    for leg in ("prefill", "decode"):
        state = (("endpoint", stub.url), ("leg", leg), ("state", "closed"))
        assert samples[("pdclient_endpoint_state", state)] == 1
    assert ("pdclient_cost_ms_per_token", (("endpoint", ""), ("line", "handoff"))) in samples


async def test_proxy_metrics_carry_build_info_and_no_created_series(proxy: RunningProxy) -> None:
    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="-") as client:
        await client.chat.completions.create(model="m", messages=MESSAGES)
    async with httpx.AsyncClient() as http:
        text = (await http.get(proxy.url + "/metrics")).text
        openmetrics = await http.get(proxy.url + "/metrics", headers={"accept": "application/openmetrics-text"})
    build = (("python", platform.python_version()), ("version", pdclient.__version__))
    assert metric_samples(text)[("pdclient_build_info", build)] == 1
    assert "_created" not in text and "pdclient_calls_total" in text
    assert openmetrics.headers["content-type"].startswith("application/openmetrics-text")
    assert "_created" not in openmetrics.text and "pdclient_build_info" in openmetrics.text
    # The setting is the proxy's scrape's, not prometheus_client's process-wide one.
    assert prometheus_client.metrics._use_created is True


def test_an_observer_of_ones_own_exports_build_info_and_leaves_created_alone() -> None:
    registry = CollectorRegistry()
    observer = PrometheusObserver(registry)
    one_call(observer, PDTrace(request_id="a", route="chat"))
    samples = scrape(registry)
    build = (("python", platform.python_version()), ("version", pdclient.__version__))
    assert samples[("pdclient_build_info", build)] == 1
    assert any(name == "pdclient_calls_created" for name, _ in samples)  # the user's registry, as they set it
