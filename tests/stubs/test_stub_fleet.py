"""The stub's fleet models: vLLM-shaped /metrics and /health, slots, step time, prefix cache."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from pdclient.fleet import ServerLoad, parse_metrics
from tests.polling import wait_until
from tests.stubserver import MODEL, PrefixCacheModel, StubServer, render

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer(max_running=2, step_seconds=0.2) as server:
        yield server


def root(stub: StubServer) -> str:
    return stub.url.removesuffix("/v1")


def hold_streams(stub: StubServer, n: int) -> list[threading.Thread]:
    def stream() -> None:
        with httpx.Client() as client:
            client.post(stub.url + "/chat/completions", json=CHAT).read()

    threads = [threading.Thread(target=stream) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_metrics_count_running_and_waiting_requests(stub: StubServer) -> None:
    stub.kv_usage = 0.0
    assert parse_metrics(httpx.get(root(stub) + "/metrics").text, model=MODEL) == ServerLoad(0, 0, 0.0)
    stub.kv_usage = None
    threads = hold_streams(stub, 1)
    wait_until(lambda: stub.running == 1)
    assert parse_metrics(httpx.get(root(stub) + "/metrics").text) == ServerLoad(0, 1, 0.5), "1 of 2 slots"
    for t in threads:
        t.join()

    threads = hold_streams(stub, 5)
    stub.kv_usage = 0.42
    wait_until(lambda: stub.running + stub.waiting == 5)
    load = parse_metrics(httpx.get(root(stub) + "/metrics").text, model=MODEL)
    assert load == ServerLoad(waiting=3, running=2, kv_usage=0.42), "5 streams (1 s each), 2 slots"
    for t in threads:
        t.join()
    assert parse_metrics(httpx.get(root(stub) + "/metrics").text) == ServerLoad(0, 0, 0.42)


def test_step_time_grows_with_the_batch() -> None:
    with StubServer(step_seconds=0.01, step_per_running=0.02) as stub:
        started = time.perf_counter()
        httpx.post(stub.url + "/chat/completions", json=CHAT).read()
        alone = time.perf_counter() - started
        assert alone >= 0.15, "5 steps of 0.01 + 0.02 x 1"


def test_health_follows_the_switch_and_the_control_endpoint(stub: StubServer) -> None:
    assert httpx.get(root(stub) + "/health").status_code == 200
    stub.healthy = False
    assert httpx.get(root(stub) + "/health").status_code == 503
    answer = httpx.post(root(stub) + "/stub/control", json={"healthy": True, "kv_usage": 0.9}).json()
    assert answer == {"healthy": True, "kv_usage": 0.9} and stub.healthy and stub.kv_usage == 0.9
    httpx.post(root(stub) + "/stub/control", json={"kv_usage": None})
    assert stub.kv_usage is None


def test_prefix_cache_model_hits_the_prefixes_it_has_seen() -> None:
    cache = PrefixCacheModel(capacity_chars=64 * 100, block_chars=64, seconds_per_char=20e-6)
    system = {"role": "system", "content": "S" * 3000}
    first = {"model": "m", "messages": [system, {"role": "user", "content": "one"}]}
    second = {"model": "m", "messages": [system, {"role": "user", "content": "two"}]}
    with StubServer(prefix_cache=cache) as stub, httpx.Client() as client:
        prefill = {"kv_transfer_params": {"do_remote_decode": True}}
        client.post(stub.url + "/chat/completions", json={**first, **prefill})
        cold = cache.compute_seconds
        client.post(stub.url + "/chat/completions", json={**second, **prefill})
        warm = cache.compute_seconds - cold
        text = client.get(root(stub) + "/metrics").text
    total = len(render(first)) + len(render(second))
    assert cache.queried_chars == total
    assert cache.hit_chars == 3008, "the system turn's whole blocks: 47 x 64"
    assert f'vllm:prefix_cache_hits_total{{engine="0",model_name="{MODEL}"}} 3008.0' in text
    assert cold == pytest.approx(len(render(first)) * 20e-6)
    assert warm == pytest.approx((len(render(second)) - 3008) * 20e-6), "only the uncached tail costs"


def test_prefix_cache_model_is_bounded_and_evicts_tails_first() -> None:
    cache = PrefixCacheModel(capacity_chars=10 * 8, block_chars=8)
    shared = "p" * 40
    cache.lookup_and_fill(shared + "a" * 40)
    cache.lookup_and_fill(shared + "b" * 40)  # 15 blocks wanted, 10 kept: a's tail goes
    assert cache.lookup_and_fill(shared)[0] == 40
    assert cache.lookup_and_fill(shared + "a" * 40)[0] < 80


def test_stubs_listen_on_other_loopback_addresses() -> None:
    with StubServer(host="127.0.0.3") as stub:
        assert stub.url.startswith("http://127.0.0.3:")
        assert httpx.get(root(stub) + "/health").status_code == 200


def test_background_requests_hold_slots_and_count_as_running() -> None:
    with StubServer(max_running=4, step_seconds=0.2) as stub:
        stub.background = 3
        assert parse_metrics(httpx.get(root(stub) + "/metrics").text) == ServerLoad(0, 3, 0.75)
        threads = hold_streams(stub, 2)
        wait_until(lambda: stub.waiting == 1)
        assert parse_metrics(httpx.get(root(stub) + "/metrics").text) == ServerLoad(1, 4, 1.0)
        for t in threads:
            t.join()
