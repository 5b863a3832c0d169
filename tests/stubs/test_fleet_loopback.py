"""Issue 12's cores and drivers against real loopback stubs, without the clients.

Calls here go the way the Call makes them: ``route_decision()`` on a pool, ``request_overrides``
for a discovered member, one httpx request, ``acquire``/``release`` around it. The same
features through PDChatClient / AsyncPDChatClient: ``test_fleet_clients.py``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack

import httpx
import pytest

from pdclient.fleet import (
    BackgroundTask,
    BackgroundThread,
    Core,
    DiscoverySettings,
    DnsDiscovery,
    HealthProber,
    HealthSettings,
    LoadScraper,
    Resolver,
    ScrapeSettings,
    request_overrides,
)
from pdclient.pools import BreakerSettings, Endpoint, EndpointPool, route_decision
from pdclient.routing import LeastOutstanding, LoadAware, RouteRequest, RoutingPolicy
from tests.polling import until, wait_until
from tests.stubs._fleet import Dripping, Zone, hold, start_on
from tests.stubserver import StubServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
FAST_SCRAPES = ScrapeSettings(interval=0.05, staleness=1.0, timeout=1.0)
FAST_PROBES = HealthSettings(interval=0.05, timeout=1.0, failures=3, successes=2)


class Turns:
    """Round robin on the richer policy interface (spreads sequential calls in these tests)."""

    def __init__(self) -> None:
        self.turn = 0

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
        self.turn += 1
        return endpoints[self.turn % len(endpoints)]


class Pinned:
    def __init__(self, url: str) -> None:
        self.url = url

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
        return next(e for e in endpoints if e.url == self.url)


def make_pool(urls: list[str], failures: int = 3) -> EndpointPool:
    return EndpointPool("decode", tuple(urls), LeastOutstanding(), BreakerSettings(failures, 30.0))


def call(http: httpx.Client, pool: EndpointPool, policy: RoutingPolicy) -> tuple[Endpoint, httpx.Response]:
    endpoint = route_decision(pool, policy, RouteRequest("decode")).endpoint
    headers, extensions = request_overrides(endpoint)
    endpoint.acquire()
    try:
        response = http.post(endpoint.url + "/chat/completions", json=CHAT, headers=headers, extensions=extensions)
        response.read()
    except httpx.TransportError:
        endpoint.release(ok=False)
        raise
    endpoint.release(ok=response.status_code < 500)
    return endpoint, response


@pytest.fixture
def stubs() -> Iterator[list[StubServer]]:
    with ExitStack() as stack:
        yield [stack.enter_context(StubServer(max_running=1, step_seconds=0.15, record=False)) for _ in range(3)]


# -- load signals ---------------------------------------------------------------------------


def test_scraper_sees_other_clients_load_and_load_aware_avoids_it(stubs: list[StubServer]) -> None:
    pool = make_pool([s.url for s in stubs])
    busy = pool.endpoints[0]
    driver = BackgroundThread([LoadScraper(lambda: pool.endpoints, FAST_SCRAPES)])
    driver.start()
    try:
        wait_until(lambda: all(e.load is not None for e in pool.endpoints))
        assert LoadAware().choose(pool.endpoints, RouteRequest("decode")) is not None
        for quick in stubs[1:]:
            quick.step_seconds = 0.01
        threads = hold(stubs[0], 3)  # 3 x 6 steps of 0.15 s, one at a time: busy for ~2.7 s
        wait_until(lambda: busy.load is not None and (busy.load.waiting, busy.load.running) == (2, 1))
        policy = LoadAware()
        with httpx.Client(timeout=30) as http:
            chosen = {call(http, pool, policy)[0].url for _ in range(4)}
        assert busy.url not in chosen, "least-outstanding would have started there: this process has none on it"
        for t in threads:
            t.join()
        wait_until(lambda: busy.load is not None and busy.load.running == 0)
    finally:
        driver.close()


async def test_scraper_under_the_async_driver(stubs: list[StubServer]) -> None:
    pool = make_pool([s.url for s in stubs])
    driver = BackgroundTask([LoadScraper(lambda: pool.endpoints, FAST_SCRAPES)])
    driver.start()
    try:
        threads = hold(stubs[1], 2)
        await until(lambda: pool.endpoints[1].load is not None and pool.endpoints[1].load.waiting == 1)
        assert LoadAware().choose(pool.endpoints, RouteRequest("decode")) is not pool.endpoints[1]
        await asyncio.to_thread(lambda: [t.join() for t in threads])
    finally:
        await driver.aclose()


def test_a_server_without_metrics_goes_stale() -> None:
    with StubServer(record=False) as good:
        pool = make_pool([good.url, "http://127.0.0.1:9/v1"])  # nothing listens on the discard port
        driver = BackgroundThread([LoadScraper(lambda: pool.endpoints, FAST_SCRAPES)])
        driver.start()
        try:
            wait_until(lambda: pool.endpoints[0].load is not None)
            assert pool.endpoints[1].load is None
            assert LoadAware().scores(pool.endpoints) is None, "not comparable: least-outstanding"
        finally:
            driver.close()


# -- health checks ------------------------------------------------------------------------------


def health_run(driver_factory: Callable[[list[Core]], BackgroundThread]) -> None:
    with StubServer(record=False) as a, StubServer(record=False) as b:
        pool = make_pool([a.url, b.url], failures=100)  # requests alone would hardly open it
        prober = HealthProber(lambda: pool.endpoints, FAST_PROBES)
        driver = driver_factory([prober])
        driver.start()
        try:
            first = pool.endpoints[0]
            a.healthy = False
            wait_until(lambda: first.state == "open")
            assert all(pool.decide(RouteRequest("decode")).endpoint is pool.endpoints[1] for _ in range(5))
            time.sleep(0.3)
            assert first.state == "open", "probes keep it open"
            a.healthy = True
            wait_until(lambda: first.state == "closed")
        finally:
            driver.close()


def test_health_probes_open_and_close_breakers() -> None:
    health_run(lambda cores: BackgroundThread(cores))


def test_a_server_that_goes_away_is_kept_out() -> None:
    a = StubServer(record=False).start()
    with StubServer(record=False) as b:
        pool = make_pool([a.url, b.url], failures=100)
        driver = BackgroundThread([HealthProber(lambda: pool.endpoints, FAST_PROBES)])
        driver.start()
        try:
            wait_until(lambda: driver.cores[0].state(pool.endpoints[0]).failures == 0)  # type: ignore[attr-defined]
            a.stop()
            wait_until(lambda: pool.endpoints[0].state == "open")
        finally:
            driver.close()


async def test_health_probes_under_the_async_driver() -> None:
    with StubServer(record=False) as a, StubServer(record=False) as b:
        pool = make_pool([a.url, b.url], failures=100)
        driver = BackgroundTask([HealthProber(lambda: pool.endpoints, FAST_PROBES)])
        driver.start()
        try:
            a.healthy = False
            await until(lambda: pool.endpoints[0].state == "open")
            a.healthy = True
            await until(lambda: pool.endpoints[0].state == "closed")
        finally:
            await driver.aclose()


# -- a member that never finishes its answers -------------------------------------------------

BOUNDED_PROBES = HealthSettings(interval=0.05, timeout=0.3, failures=3, successes=2)
BOUNDED_SCRAPES = ScrapeSettings(interval=0.05, staleness=1.0, timeout=0.3)
FOUND_WITHIN = 3 * (0.3 + 0.05) + 1.5
"""Three probes that each fail at their deadline, and slack for a loaded machine (the
dripping answer itself would take 1,000 s)."""


def probes_and_scrapes(pool: EndpointPool) -> list[Core]:
    return [HealthProber(lambda: pool.endpoints, BOUNDED_PROBES), LoadScraper(lambda: pool.endpoints, BOUNDED_SCRAPES)]


def seen(good: StubServer) -> tuple[int, int]:
    return good.counts.get("/health", 0), good.counts.get("/metrics", 0)


def check_no_one_delayed(good: StubServer, drip: Dripping, pool: EndpointPool, before: tuple[int, int]) -> None:
    """Over the last 0.6 s (12 intervals) the good member was probed and scraped on time,
    and every scrape of the dripping one was given up at its deadline."""
    probes, scrapes = (after - then for after, then in zip(seen(good), before, strict=True))
    assert probes >= 4 and scrapes >= 4, f"the good member got {probes} probes and {scrapes} scrapes in 0.6 s"
    sample = pool.endpoints[0].load
    assert sample is not None and sample.fresh(time.monotonic())
    assert pool.endpoints[0].state == "closed"
    assert drip.hits.get("/metrics", 0) >= 3, "each scrape of the dripping member ends at its deadline"


def test_a_dripping_member_is_found_within_the_bound_and_delays_no_one() -> None:
    with StubServer(record=False) as good, Dripping() as drip:
        pool = make_pool([good.url, drip.url], failures=100)
        driver = BackgroundThread(probes_and_scrapes(pool))
        driver.start()
        try:
            wait_until(lambda: pool.endpoints[1].state == "open", timeout=FOUND_WITHIN)
            before = seen(good)
            time.sleep(0.6)
            check_no_one_delayed(good, drip, pool, before)
        finally:
            driver.close()


async def test_a_dripping_member_under_the_async_driver() -> None:
    with StubServer(record=False) as good, Dripping() as drip:
        pool = make_pool([good.url, drip.url], failures=100)
        driver = BackgroundTask(probes_and_scrapes(pool))
        driver.start()
        try:
            await until(lambda: pool.endpoints[1].state == "open", limit=FOUND_WITHIN)
            before = seen(good)
            await asyncio.sleep(0.6)
            check_no_one_delayed(good, drip, pool, before)
        finally:
            await driver.aclose()


# -- DNS discovery --------------------------------------------------------------------------------


def test_discovered_members_serve_calls_and_leave_without_dropping_them() -> None:
    stubs = start_on(["127.0.0.2", "127.0.0.3", "127.0.0.4"], step_seconds=0.01)
    port = stubs[0].port
    zone = Zone(["127.0.0.2", "127.0.0.3"])
    pool = make_pool([f"http://vllm-decode.test:{port}/v1"])
    discovery = DnsDiscovery(pool, DiscoverySettings(interval=0.05))
    driver = BackgroundThread([discovery], resolver=zone)
    driver.start()
    try:
        wait_until(lambda: len(pool.endpoints) == 2)
        policy = Turns()
        with httpx.Client(timeout=30) as http:
            seen = {call(http, pool, policy)[0].url for _ in range(4)}
            assert seen == {f"http://127.0.0.2:{port}/v1", f"http://127.0.0.3:{port}/v1"}
            for stub in stubs[:2]:
                assert {r.headers["host"] for r in stub.received} == {f"vllm-decode.test:{port}"}

            # a slow stream on .2, then .2 leaves DNS and .4 joins
            stubs[0].step_seconds = 0.1
            leaving = pool.endpoints[0]
            result: list[httpx.Response] = []
            thread = threading.Thread(target=lambda: result.append(call(http, pool, Pinned(leaving.url))[1]))
            thread.start()
            wait_until(lambda: leaving.in_flight == 1)
            zone.addresses = ["127.0.0.3", "127.0.0.4"]
            wait_until(lambda: [e.url for e in pool.endpoints] == [f"http://127.0.0.{i}:{port}/v1" for i in (3, 4)])
            assert leaving.in_flight == 1, "still streaming"
            thread.join()
            assert result[0].status_code == 200 and b"[DONE]" in result[0].content, "the removed member finished it"
            assert leaving.in_flight == 0
            later = {call(http, pool, policy)[0].url for _ in range(4)}
            assert later == {f"http://127.0.0.3:{port}/v1", f"http://127.0.0.4:{port}/v1"}
    finally:
        driver.close()
        for stub in stubs:
            stub.stop()


async def test_discovery_under_the_async_driver() -> None:
    zone: Resolver = Zone(["127.0.0.5", "127.0.0.6"])
    pool = make_pool(["http://vllm-decode.test:8000/v1"])
    driver = BackgroundTask([DnsDiscovery(pool, DiscoverySettings(interval=0.05))], resolver=zone)
    driver.start()
    try:
        await until(lambda: len(pool.endpoints) == 2)
        assert [e.host_name for e in pool.endpoints] == ["vllm-decode.test"] * 2
    finally:
        await driver.aclose()
