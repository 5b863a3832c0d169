"""Issue 12 through the real clients, on the fake vLLM through respx: route decisions in the
trace and its headers, the prompt text computed only for a policy that reads it, a
discovered member's DNS name on every leg (the KV release too), and the routing metrics."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import httpx
import openai
import pytest
import respx

from pdclient import DiscoverySettings, PDTrace, RetrySettings
from tests.fake_vllm import DECODE, PREFILL, FakeVLLM
from tests.polling import until
from tests.twins import Twin

P1, P2 = "http://prefill-1.test:8100/v1", "http://prefill-2.test:8100/v1"
SYSTEM = "You are the assistant of a very long system prompt. " * 40
FAST = RetrySettings(prefill_attempts=2, backoff_initial=0.001, backoff_max=0.01)


def conversation(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


async def raw_chat(twin: Twin, **kwargs: Any) -> httpx.Headers:
    kwargs.setdefault("model", "m")
    raw = await twin.call(twin.client.chat.completions.with_raw_response.create, **kwargs)
    return raw.headers  # type: ignore[no-any-return]


async def test_the_trace_names_each_legs_route(mode: str, fake: FakeVLLM) -> None:
    traces: list[PDTrace] = []
    twin = Twin(mode, on_trace=traces.append)
    headers = await raw_chat(twin, messages=conversation("hi"))
    # By default a chat conversation's decode leg goes by rendezvous on its affinity key.
    assert (headers["x-pd-prefill-route"], headers["x-pd-decode-route"]) == ("least_outstanding", "rendezvous/key")
    assert PDTrace.from_headers(headers).decode_route == "rendezvous/key"
    assert traces[0].prefill_route == "least_outstanding"
    await twin.close()

    twin = Twin(mode, routing="affinity", on_trace=traces.append)
    await raw_chat(twin, messages=conversation("hi"))
    assert traces[-1].prefill_route == traces[-1].decode_route == "affinity/key"
    await twin.close()


async def test_cache_aware_decisions_through_the_client(mode: str) -> None:
    fake = FakeVLLM()
    traces: list[PDTrace] = []
    with fake.routes(P1, DECODE) as router:
        router.post(f"{P2}/chat/completions").mock(side_effect=fake.respond)
        twin = Twin(mode, prefill_base_url=[P1, P2], prefill_routing="cache_aware", on_trace=traces.append)
        first = await raw_chat(twin, messages=conversation("first question"))
        second = await raw_chat(twin, messages=conversation("another question"))
        await twin.close()
    assert traces[0].prefill_route is not None and traces[0].prefill_route.startswith("cache_aware/affinity match=0 ")
    route = traces[1].prefill_route
    assert route is not None and route.startswith("cache_aware/cache match="), route
    match, prompt = (int(part.split("=")[1]) for part in route.split()[1:])
    assert 0.9 < match / prompt < 1, "the shared system prompt, not the new question"
    assert traces[1].prefill_url == traces[0].prefill_url
    assert traces[1].decode_route == "rendezvous/key"
    assert first["x-pd-prefill-route"].isascii() and second["x-pd-prefill-route"] == route


def count_plan_text(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    import pdclient.handoff._call

    calls: list[int] = []
    real = pdclient.handoff._call.plan_text

    def counted(plan: Any) -> str | None:
        calls.append(1)
        return real(plan)

    monkeypatch.setattr(pdclient.handoff._call, "plan_text", counted)
    return calls


async def test_prompt_text_only_for_a_policy_that_reads_it_and_once_per_call(
    mode: str, fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = count_plan_text(monkeypatch)
    twin = Twin(mode, routing="affinity")
    await twin.chat(messages=conversation("hi"))
    assert calls == [], "affinity reads the key, not the text"
    await twin.close()

    twin = Twin(mode, prefill_routing="cache_aware", retries=FAST)
    fake.router.routes["prefill"].side_effect = [httpx.Response(503), fake.respond]
    traces: list[PDTrace] = []
    await twin.chat(twin.client.with_options(on_trace=traces.append), messages=conversation("hi"))
    assert traces[0].prefill_attempts == 2 and calls == [1], "two prefill attempts, one rendering"
    await twin.close()


class Zone:
    """The resolver hook: the addresses a name has now."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.lookups = 0

    def __call__(self, host: str, port: int) -> list[str]:
        assert (host, port) == ("vllm-decode.test", 8200)
        self.lookups += 1
        return list(self.addresses)


NAMED = "http://vllm-decode.test:8200/v1"
ADDRESSES = ["10.9.0.1", "10.9.0.2"]


async def test_a_discovered_member_gets_its_name_on_every_leg_and_the_release(mode: str) -> None:
    fake = FakeVLLM()
    zone = Zone(ADDRESSES)
    seen: list[httpx.Request] = []

    def decode(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = json.loads(request.content)
        if body.get("max_tokens") == 1 and "kv_transfer_params" in body:
            return httpx.Response(200, json=fake.answers.decode(request.url.path, body))  # the KV release
        raise httpx.ConnectError("refused", request=request)

    with fake.routes(PREFILL, NAMED) as router:
        for address in ADDRESSES:
            router.route(host=address, port=8200).mock(side_effect=decode)
        twin = Twin(mode, decode_base_url=NAMED, discovery=DiscoverySettings(interval=0.05, resolver=zone))
        fleet = twin.client.pd_fleet
        assert fleet.background is not None and fleet.background.driver is None, "nothing before the first call"
        assert [m.id for m in (await twin.call(twin.client.models.list)).data] == ["stub-model"]
        assert router.routes["models"].calls.last.request.headers["host"] == "vllm-decode.test:8200"
        await until(lambda: [e.url for e in fleet.decode.endpoints] == [f"http://{a}:8200/v1" for a in ADDRESSES])

        with pytest.raises(openai.APIConnectionError):
            await twin.chat(messages=conversation("hi"))
        await twin.close()
    legs = [("release" if json.loads(r.content).get("max_tokens") == 1 else "decode", r) for r in seen]
    assert [name for name, _ in legs] == ["decode", "decode", "release"]
    for _, request in legs:
        assert request.url.host in ADDRESSES and request.headers["host"] == "vllm-decode.test:8200"
        assert "sni_hostname" not in request.extensions, "plain http: no TLS"
    assert fleet.background.driver is None, "closed"


def test_https_members_present_the_name_as_sni() -> None:
    from pdclient.fleet import request_overrides
    from pdclient.pools import BreakerSettings, Endpoint

    endpoint = Endpoint("https://10.9.0.1:8443/v1", BreakerSettings(), time.monotonic, host_name="vllm.test")
    assert request_overrides(endpoint) == ({"host": "vllm.test:8443"}, {"sni_hostname": "vllm.test"})


def test_routing_metrics(fake: FakeVLLM) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from pdclient.metrics import PrometheusObserver

    registry = prometheus_client.CollectorRegistry()
    twin = Twin("sync", prefill_routing="cache_aware", observers=[PrometheusObserver(registry)])
    for question in ("one", "two", "three"):
        twin.client.chat.completions.create(model="m", messages=conversation(question))
    twin.client.close()

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(f"pdclient_{name}", labels) or 0.0

    assert value("routing_decisions_total", leg="prefill", policy="cache_aware", rule="affinity") == 1
    assert value("routing_decisions_total", leg="prefill", policy="cache_aware", rule="cache") == 2
    assert value("routing_decisions_total", leg="decode", policy="rendezvous", rule="key") == 3
    prompt = value("routed_prompt_chars_total", leg="prefill")
    assert 0.5 * prompt < value("routed_match_chars_total", leg="prefill") < prompt


def test_no_background_thread_when_off(fake: FakeVLLM) -> None:
    twin = Twin("sync")
    twin.client.chat.completions.create(model="m", messages=conversation("hi"))
    assert twin.client.pd_fleet.background is None
    assert not [t for t in threading.enumerate() if t.name == "pdclient-background"]
    twin.client.close()


@respx.mock(assert_all_called=False)
def test_no_background_is_made_for_copies_either() -> None:
    twin = Twin("sync")
    copy = twin.client.with_options(timeout=3, on_trace=lambda trace: None)
    assert copy.pd_fleet is twin.client.pd_fleet and copy.pd_fleet.background is None
