"""Issue 12 through PDChatClient and AsyncPDChatClient on loopback stubs that serve /metrics
and /health: load-aware routing around another client's load, health probes feeding the
breakers (and the 503 when none is admitted), DNS discovery of several 127.0.0.x behind
one name, cache-aware prefill routing; what runs (a thread, a task) and when (the first
call, until close), shared by copies, and that nothing runs when the features are off."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from typing import Any

import anyio
import openai
import pytest

from pdclient import BreakerSettings, DiscoverySettings, HealthSettings, PDTrace, ScrapeSettings
from pdclient.fleet import BackgroundTask, BackgroundThread
from pdclient.routing import CacheAware, RoundRobin
from tests.polling import until
from tests.stubs._fleet import Zone, hold, start_on
from tests.stubserver import PrefixCacheModel, StubServer
from tests.twins import Twin

FAST_SCRAPES = ScrapeSettings(interval=0.05, staleness=1.0, timeout=1.0)
FAST_PROBES = HealthSettings(interval=0.05, timeout=1.0, failures=2, successes=2)
MESSAGES = [{"role": "user", "content": "hi"}]


async def step(iterator: Any) -> Any:
    """The next chunk of a sync or async stream."""
    return next(iterator) if isinstance(iterator, Iterator) else await iterator.__anext__()


def threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "pdclient-background"]


def tasks() -> list[asyncio.Task[Any]]:
    try:
        return [t for t in asyncio.all_tasks() if t.get_name() == "pdclient-background" and not t.done()]
    except RuntimeError:  # no running loop (sync mode)
        return []


def assert_driver(twin: Twin) -> None:
    """A sync client's fleet runs a thread; an async one's, a task on this loop."""
    background = twin.client.pd_fleet.background
    assert background is not None
    if twin.mode == "sync":
        assert isinstance(background.driver, BackgroundThread) and background.running
        assert background.driver._thread in threads()
    else:
        assert isinstance(background.driver, BackgroundTask) and background.running
        assert background.driver._task in tasks()


def scrapes_and_probes(*stubs: StubServer) -> list[str]:
    return [r.path for s in stubs for r in s.received if r.path in ("/metrics", "/health")]


@pytest.fixture
def decodes() -> Iterator[list[StubServer]]:
    with ExitStack() as stack:
        yield [stack.enter_context(StubServer(max_running=1, step_seconds=0.01)) for _ in range(3)]


@pytest.fixture
def prefill() -> Iterator[StubServer]:
    with StubServer(record=False) as stub:
        yield stub


# -- load signals ---------------------------------------------------------------------------------


async def test_load_aware_routes_around_another_clients_load(
    mode: str, prefill: StubServer, decodes: list[StubServer]
) -> None:
    traces: list[PDTrace] = []
    twin = Twin(
        mode,
        prefill_base_url=prefill.url,
        decode_base_url=[d.url for d in decodes],
        routing="load_aware",
        load_signals=FAST_SCRAPES,
        on_trace=traces.append,
    )
    fleet = twin.client.pd_fleet
    assert fleet.background is not None and fleet.background.driver is None, "nothing before the first call"
    await twin.chat(messages=MESSAGES)
    assert_driver(twin)
    busy = fleet.decode.endpoints[0]
    decodes[0].step_seconds = 0.15
    others = hold(decodes[0], 3)  # another process's calls: 3 x 6 steps of 0.15 s, one at a time
    await until(lambda: busy.load is not None and (busy.load.waiting, busy.load.running) == (2, 1))
    traces.clear()
    for _ in range(4):
        await twin.chat(messages=MESSAGES)
    assert busy.url not in {t.decode_url for t in traces}, "least-outstanding would have gone there first"
    assert all(t.decode_route and t.decode_route.startswith("load_aware/load score=") for t in traces)
    # Not score=0: on a loaded machine a scrape can land while this test's own prefill runs.
    prefill_routes = [t.prefill_route for t in traces]
    assert all(r and r.startswith("load_aware/load score=") for r in prefill_routes), "the prefill pool is scraped too"
    driver = fleet.background.driver
    await twin.close()
    assert fleet.background.driver is None and not driver.running  # type: ignore[union-attr]
    await anyio.to_thread.run_sync(lambda: [t.join() for t in others])


async def test_load_aware_weighs_a_server_slower_at_the_same_load(
    mode: str, prefill: StubServer, decodes: list[StubServer]
) -> None:
    """Idle servers all score 0 by their counts; the one whose steps take 0.4 s is seen in
    this process's own streams (time per read) and left alone. The step is far above what a
    loaded machine adds to a fast server's reads (at 0.12 s, under a load average of 11, one
    such hiccup once sent a stream to the slow server)."""
    traces: list[PDTrace] = []
    twin = Twin(
        mode,
        prefill_base_url=prefill.url,
        decode_base_url=[d.url for d in decodes],
        decode_routing="load_aware",
        load_signals=FAST_SCRAPES,
        on_trace=traces.append,
    )
    decodes[2].step_seconds = 0.4
    endpoints = twin.client.pd_fleet.decode.endpoints
    for _ in range(60):  # ties go to a random member: until each has answered a stream
        await twin.stream_text(messages=MESSAGES)
        if all(e.latency.estimate() is not None for e in endpoints):
            break
    slow, fast = endpoints[2].latency.estimate(), max(e.latency.estimate() or 0 for e in endpoints[:2])
    assert slow is not None and slow > 3 * fast, [e.latency for e in endpoints]
    traces.clear()
    for _ in range(6):
        await twin.stream_text(messages=MESSAGES)
    assert decodes[2].url not in {t.decode_url for t in traces}
    await twin.close()


# -- health checks ----------------------------------------------------------------------------------


async def test_probes_open_and_close_breakers_and_no_admitted_member_is_a_503(
    mode: str, prefill: StubServer, decodes: list[StubServer]
) -> None:
    a, b = decodes[:2]
    twin = Twin(
        mode,
        prefill_base_url=prefill.url,
        decode_base_url=[a.url, b.url],
        health_checks=FAST_PROBES,
        breaker=BreakerSettings(failures=100, cooldown=30.0),
    )
    traces: list[PDTrace] = []
    client = twin.client.with_options(on_trace=traces.append)
    await twin.chat(client, messages=MESSAGES)
    assert_driver(twin)
    first, second = twin.client.pd_fleet.decode.endpoints
    a.healthy = False
    await until(lambda: first.state == "open")
    traces.clear()
    for _ in range(3):
        await twin.chat(client, messages=MESSAGES)
    assert {t.decode_url for t in traces} == {b.url}, "requests alone (100 failures to open) never went there"

    b.healthy = False
    await until(lambda: second.state == "open")
    with pytest.raises(openai.APIStatusError) as excinfo:
        await twin.chat(client, messages=MESSAGES)
    assert excinfo.value.status_code == 503
    message = str(excinfo.value)
    assert f"{a.url} (open)" in message and f"{b.url} (open)" in message, message

    a.healthy = b.healthy = True
    await until(lambda: first.state == second.state == "closed")
    await twin.chat(client, messages=MESSAGES)
    await twin.close()


# -- DNS discovery -----------------------------------------------------------------------------------


async def test_discovery_several_addresses_behind_one_name(mode: str) -> None:
    """``localhost`` resolves (127.0.0.1 serves the first calls); the hook then says .2 and .3."""
    stubs = start_on(["127.0.0.1", "127.0.0.2", "127.0.0.3", "127.0.0.4"], step_seconds=0.01)
    port = stubs[0].port
    name = f"http://localhost:{port}/v1"
    zone = Zone(["127.0.0.2", "127.0.0.3"], name="localhost")
    url = {i: f"http://127.0.0.{i}:{port}/v1" for i in (2, 3, 4)}
    traces: list[PDTrace] = []
    twin = Twin(
        mode,
        prefill_base_url=name,
        decode_base_url=name,
        prefill_routing="cache_aware",
        decode_routing=RoundRobin(),
        discovery=DiscoverySettings(interval=0.05, resolver=zone),
        on_trace=traces.append,
    )
    fleet = twin.client.pd_fleet
    try:
        await twin.chat(messages=MESSAGES)  # starts the driver; served by the name or (async) already its addresses
        assert traces[-1].prefill_url in (name, url[2], url[3])
        await until(lambda: [e.url for e in fleet.decode.endpoints] == [url[2], url[3]])
        assert [e.url for e in fleet.prefill.endpoints] == [url[2], url[3]]
        for stub in stubs:
            stub.clear()
        traces.clear()
        for i in range(4):
            await twin.chat(messages=[{"role": "user", "content": f"question {i}: " + "and more " * 40}])
        assert {t.decode_url for t in traces} == {url[2], url[3]}
        legs = [r for s in stubs[1:3] for r in s.received if r.leg in ("prefill", "decode")]
        assert len(legs) == 8 and {r.headers["host"] for r in legs} == {f"localhost:{port}"}

        # Streams on a member that leaves DNS finish on it; the prefill index forgets it.
        policy = fleet.prefill.policy
        assert isinstance(policy, CacheAware)
        leaving_url = next(
            e.url for e in fleet.prefill.endpoints if len(policy.index._lru.get(e.url, ())) * policy.index.chunk_chars
        )
        staying = url[3] if leaving_url == url[2] else url[2]
        for stub in stubs:
            stub.step_seconds = 0.1
        streams = [await twin.chat(messages=MESSAGES, stream=True) for _ in range(2)]  # round robin: one each
        iterators: list[Any] = [iter(s) if mode == "sync" else s.__aiter__() for s in streams]
        chunks: list[list[Any]] = [[await step(it)] for it in iterators]
        leaving = next(e for e in fleet.decode.endpoints if e.url == leaving_url)
        assert leaving.in_flight == 1
        zone.addresses = ["127.0.0.4", staying.split("/")[2].split(":")[0]]
        await until(lambda: leaving not in fleet.decode.endpoints)
        assert leaving.in_flight == 1, "still streaming"
        for it, got in zip(iterators, chunks, strict=True):
            got += list(it) if mode == "sync" else [c async for c in it]
            text = "".join(c.choices[0].delta.content or "" for c in got if c.choices)
            assert text == "Hello from the decode stub", "both finished, the removed member's too"
        assert leaving.in_flight == 0
        assert len(policy.index._lru.get(leaving_url, ())) * policy.index.chunk_chars == 0, (
            "the prefill index forgot the removed member"
        )
        assert {e.url for e in fleet.decode.endpoints} == {url[4], staying}
    finally:
        await twin.close()
        for stub in stubs:
            stub.stop()


# -- cache-aware prefill routing ---------------------------------------------------------------------


async def test_cache_aware_sends_a_shared_prompt_where_it_was_sent(mode: str) -> None:
    with ExitStack() as stack:
        prefills = [stack.enter_context(StubServer(prefix_cache=PrefixCacheModel(), record=False)) for _ in range(3)]
        decode = stack.enter_context(StubServer(record=False))
        traces: list[PDTrace] = []
        twin = Twin(
            mode,
            prefill_base_url=[p.url for p in prefills],
            decode_base_url=decode.url,
            prefill_routing="cache_aware",
            on_trace=traces.append,
        )
        system = {"role": "system", "content": "Answer in the house style. " * 200}
        for user in range(8):
            await twin.chat(messages=[system, {"role": "user", "content": f"user {user} asks"}])
        await twin.close()
        assert twin.client.pd_fleet.background is None, "cache-aware alone needs no background work"
    assert len({t.prefill_url for t in traces}) == 1
    assert [t.prefill_route.split()[0] for t in traces if t.prefill_route] == ["cache_aware/affinity"] + [
        "cache_aware/cache"
    ] * 7
    hits = sum(p.prefix_cache.hit_chars for p in prefills if p.prefix_cache)
    queried = sum(p.prefix_cache.queried_chars for p in prefills if p.prefix_cache)
    assert hits / queried > 0.8


# -- what runs, and when -----------------------------------------------------------------------------


async def test_nothing_runs_when_every_feature_is_off(
    mode: str, prefill: StubServer, decodes: list[StubServer]
) -> None:
    before = len(threads())
    twin = Twin(mode, prefill_base_url=prefill.url, decode_base_url=[d.url for d in decodes], routing="affinity")
    for _ in range(3):
        await twin.chat(messages=MESSAGES)
    await anyio.sleep(0.3)
    assert twin.client.pd_fleet.background is None
    assert len(threads()) == before and not tasks()
    assert scrapes_and_probes(*decodes) == []
    await twin.close()


async def test_copies_share_one_driver_and_close_stops_it(
    mode: str, prefill: StubServer, decodes: list[StubServer]
) -> None:
    before = len(threads())
    twin = Twin(mode, prefill_base_url=prefill.url, decode_base_url=decodes[0].url, health_checks=FAST_PROBES)
    copy = twin.client.with_options(timeout=20, on_trace=lambda trace: None)
    assert copy.pd_fleet is twin.client.pd_fleet
    await twin.chat(copy, messages=MESSAGES)
    await twin.chat(messages=MESSAGES)
    assert_driver(twin)
    assert len(threads()) == before + (mode == "sync") and len(tasks()) == (mode == "async")
    await until(lambda: len(scrapes_and_probes(decodes[0])) >= 2)
    assert set(scrapes_and_probes(decodes[0])) == {"/health"}, "probes only: no /metrics without load signals"
    await twin.close()
    assert len(threads()) == before and not tasks()
    seen = len(scrapes_and_probes(decodes[0]))
    await anyio.sleep(0.2)
    assert len(scrapes_and_probes(decodes[0])) == seen, "closed: no more probes"
