"""Issue 12 wired into the options and the fleet: per-leg routing, which background work
the options turn on (none when every feature is off), route decisions, and the
``Background`` lifecycle (thread, task, trio, close, garbage collection)."""

from __future__ import annotations

import asyncio
import gc
import threading
from collections.abc import Sequence

import pytest

from pdclient import (
    CacheAware,
    DiscoverySettings,
    HealthSettings,
    LoadAware,
    PDConfigError,
    PDOptions,
    RouteDecision,
    ScrapeSettings,
)
from pdclient.fleet import (
    Background,
    BackgroundTask,
    BackgroundThread,
    DnsDiscovery,
    Fetch,
    Fetched,
    Fleet,
    HealthProber,
    Job,
    JobResult,
    LoadScraper,
)
from pdclient.pools import BreakerSettings, Endpoint, EndpointPool
from pdclient.routing import POLICIES, Affinity, LeastOutstanding, RoundRobin, RouteRequest, make_policy
from tests.polling import wait_until

P, D = "http://p:8100/v1", "http://d:8200/v1"


def options(**kwargs: object) -> PDOptions:
    return PDOptions(prefill_base_url=kwargs.pop("prefill", P), decode_base_url=kwargs.pop("decode", D), **kwargs)  # type: ignore[arg-type]


def kinds(fleet: Fleet) -> list[tuple[str, str]]:
    """(core type, leg) for each core of the fleet's background work."""
    assert fleet.background is not None
    return [(type(c).__name__, repr(c).split("(")[1].split(",")[0]) for c in fleet.background.cores]


# -- per-leg routing ----------------------------------------------------------------------------


def test_routing_is_both_legs_unless_overridden() -> None:
    both = options(routing="round_robin")
    assert both.policy_for("prefill") == both.policy_for("decode") == "round_robin"
    split = options(routing="load_aware", prefill_routing="cache_aware")
    assert (split.policy_for("prefill"), split.policy_for("decode")) == ("cache_aware", "load_aware")
    fleet = Fleet(split)
    assert isinstance(fleet.prefill.policy, CacheAware) and isinstance(fleet.decode.policy, LoadAware)
    assert isinstance(Fleet(options(decode_routing="affinity")).decode.policy, Affinity)
    assert isinstance(Fleet(options(decode_routing="affinity")).prefill.policy, LeastOutstanding)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"routing": "cache_aware"}, "routing='cache_aware'"),
        ({"routing": "affinity", "decode_routing": "cache_aware"}, "decode_routing='cache_aware'"),
        ({"routing": CacheAware()}, "routing=<pdclient.routing._cache_aware.CacheAware"),
    ],
)
def test_cache_aware_routes_prefill_only(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(PDConfigError) as excinfo:
        options(**kwargs)
    assert str(excinfo.value).startswith(field) and "prefill_routing=" in str(excinfo.value)
    assert options(prefill_routing="cache_aware").policy_for("decode") == "least_outstanding"
    assert options(prefill_routing=CacheAware(), decode_routing="affinity").policy_for("decode") == "affinity"


@pytest.mark.parametrize("name", ["prefill_routing", "decode_routing"])
def test_bad_override_names_its_field(name: str) -> None:
    with pytest.raises(PDConfigError, match=f"^{name} must be one of"):
        options(**{name: "fastest"})


def test_policy_names_registered() -> None:
    assert {"load_aware", "cache_aware"} <= set(POLICIES)
    assert isinstance(make_policy("load_aware"), LoadAware)
    plain, loaded = make_policy("cache_aware"), make_policy("cache_aware", load_signals=True)
    assert isinstance(plain, CacheAware) and plain.load is None and not plain.wants_load_signals
    assert isinstance(loaded, CacheAware) and isinstance(loaded.load, LoadAware)


# -- which background work the options turn on ----------------------------------------------------


def test_nothing_runs_when_every_feature_is_off() -> None:
    for policy in ("least_outstanding", "round_robin", "power_of_two", "affinity"):
        assert Fleet(options(routing=policy)).background is None
    assert Fleet(options(prefill_routing="cache_aware")).background is None, "cache-aware needs no scrape"
    assert Fleet(options(load_signals=False, health_checks=False, discovery=False)).background is None


def test_load_aware_turns_the_scraper_on_for_its_pools() -> None:
    assert kinds(Fleet(options(routing="load_aware"))) == [("LoadScraper", "prefill"), ("LoadScraper", "decode")]
    assert kinds(Fleet(options(decode_routing="load_aware"))) == [("LoadScraper", "decode")]
    o = options(decode_routing="load_aware")
    assert o.load_signals is None and o.load_settings_for("prefill") is None
    assert o.load_settings_for("decode") == ScrapeSettings()


def test_load_signals_on_scrapes_every_pool_and_gives_cache_aware_the_load() -> None:
    settings = ScrapeSettings(interval=0.25, staleness=1.0)
    fleet = Fleet(options(prefill_routing="cache_aware", load_signals=settings))
    assert kinds(fleet) == [("LoadScraper", "prefill"), ("LoadScraper", "decode")]
    assert isinstance(fleet.prefill.policy, CacheAware) and isinstance(fleet.prefill.policy.load, LoadAware)
    assert all(c.settings is settings for c in fleet.background.cores)  # type: ignore[union-attr,attr-defined]
    assert options(load_signals=True).load_signals == ScrapeSettings()


def test_load_signals_false_with_load_aware_is_a_contradiction() -> None:
    with pytest.raises(PDConfigError, match=r"^load_signals=False, but the decode leg's routing"):
        options(decode_routing="load_aware", load_signals=False)
    with pytest.raises(PDConfigError, match=r"^load_signals=False"):
        options(routing=LoadAware(), load_signals=False)


def test_a_custom_policy_may_ask_for_load_signals() -> None:
    class Mine(LeastOutstanding):
        wants_load_signals = True

    assert kinds(Fleet(options(decode_routing=Mine()))) == [("LoadScraper", "decode")]


def test_health_checks_probe_both_pools() -> None:
    fleet = Fleet(options(health_checks=True))
    assert kinds(fleet) == [("HealthProber", "prefill"), ("HealthProber", "decode")]
    custom = HealthSettings(interval=1.0)
    assert options(health_checks=custom).health_checks is custom
    assert options(health_checks=False).health_checks is None


def test_discovery_only_for_named_urls() -> None:
    named = Fleet(options(prefill="http://10.0.0.1:8100/v1", decode="http://vllm-decode:8200/v1", discovery=True))
    assert kinds(named) == [("DnsDiscovery", "decode")]
    assert Fleet(options(prefill="http://10.0.0.1/v1", decode="http://[::1]:8/v1", discovery=True)).background is None


def test_discovery_runs_first_then_probes_then_scrapes() -> None:
    fleet = Fleet(
        options(
            prefill="http://10.0.0.1:8100/v1",
            decode="http://vllm-decode:8200/v1",
            discovery=True,
            health_checks=True,
            routing="load_aware",
        )
    )
    assert [type(c) for c in fleet.background.cores] == [  # type: ignore[union-attr]
        HealthProber,
        LoadScraper,
        DnsDiscovery,
        HealthProber,
        LoadScraper,
    ]


def resolver(host: str, port: int) -> list[str]:
    return ["127.0.0.2"]


def test_the_resolver_hook_reaches_the_driver() -> None:
    fleet = Fleet(options(decode="http://vllm-decode:8200/v1", discovery=DiscoverySettings(resolver=resolver)))
    assert fleet.background is not None and fleet.background._resolver is resolver


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"load_signals": "on"}, "^load_signals must be a ScrapeSettings"),
        ({"health_checks": 5}, "^health_checks must be a HealthSettings"),
        ({"discovery": {"interval": 1}}, "^discovery must be a DiscoverySettings"),
    ],
)
def test_bad_feature_values_name_their_field(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(PDConfigError, match=message):
        options(**kwargs)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: ScrapeSettings(interval="1"),
            r"^ScrapeSettings.interval must be a finite number of seconds > 0, got '1'",
        ),
        (lambda: ScrapeSettings(timeout=0), r"^ScrapeSettings.timeout must be a finite number of seconds > 0"),
        (lambda: ScrapeSettings(interval=3.0), r"^ScrapeSettings.staleness must be > interval"),
        (lambda: ScrapeSettings(path="metrics"), r"^ScrapeSettings.path must start with '/'"),
        (lambda: HealthSettings(failures=1.5), r"^HealthSettings.failures must be an int > 0"),
        (lambda: HealthSettings(successes=True), r"^HealthSettings.successes must be an int > 0"),
        (lambda: DiscoverySettings(interval=-1), r"^DiscoverySettings.interval must be a finite number of seconds > 0"),
        (lambda: DiscoverySettings(resolver="8.8.8.8"), r"^DiscoverySettings.resolver must be callable"),
    ],
)
def test_settings_errors_name_the_field(make: object, message: str) -> None:
    with pytest.raises(PDConfigError, match=message):
        make()  # type: ignore[operator]


def test_copies_share_the_fleet_only_while_its_fields_match() -> None:
    base = options(routing="load_aware", health_checks=True)
    fleet = Fleet(base)
    assert fleet.serves(base.replace(observers=[], on_prefill_failure="fail"))
    assert fleet.serves(base.replace(health_checks=HealthSettings()))  # equal settings
    for change in (
        {"prefill_routing": "cache_aware"},
        {"decode_routing": "round_robin"},
        {"load_signals": ScrapeSettings(interval=1.0)},
        {"health_checks": None},
        {"discovery": True},
    ):
        assert not fleet.serves(base.replace(**change)), change


# -- route decisions ------------------------------------------------------------------------------


def pool(policy: object, n: int = 3) -> EndpointPool:
    urls = tuple(f"http://s{i}:8000/v1" for i in range(n))
    return EndpointPool("decode", urls, policy, BreakerSettings(), lambda: 0.0)  # type: ignore[arg-type]


def test_decisions_name_policy_rule_and_numbers() -> None:
    p = pool(RoundRobin())
    assert str(p.decide(RouteRequest("decode"))) == "round_robin"
    p = pool(Affinity())
    assert str(p.decide(RouteRequest("decode", "k"))) == "affinity/key"
    assert str(p.decide(RouteRequest("decode"))) == "affinity/no_key"
    endpoint = p.endpoints[0]
    assert str(RouteDecision("cache_aware", endpoint, "cache", {"match": 1536, "prompt": 2048})) == (
        "cache_aware/cache match=1536 prompt=2048"
    )
    assert str(RouteDecision("load_aware", endpoint, "load", {"score": 2.5, "full": 1})) == (
        "load_aware/load score=2.5 full=1"
    )

    class Custom:
        def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
            return endpoints[-1]

    decision = pool(Custom()).decide(RouteRequest("decode"))
    assert decision.policy == "Custom" and decision.rule is None and decision.endpoint.url.startswith("http://s2")


def test_load_aware_says_stale_until_samples_are_fresh() -> None:
    p = pool(LoadAware(clock=lambda: 0.0))
    assert p.decide(RouteRequest("decode")).rule == "stale"


# -- the Background lifecycle -------------------------------------------------------------------


class Ticks:
    """A core that asks for one fetch of an unroutable URL per 10 ms and counts outcomes."""

    def __init__(self) -> None:
        self.applied = 0
        self._next = 0.0

    def due(self, now: float) -> list[Job]:
        if now < self._next:
            return []
        self._next = now + 0.01
        return [Job(self, Fetch("http://127.0.0.1:9/metrics", 0.05))]

    def next_due(self) -> float:
        return self._next

    def apply(self, job: Job, outcome: JobResult, now: float) -> None:
        assert isinstance(outcome, Fetched)
        self.applied += 1


def test_sync_background_is_one_thread_started_once_and_stopped_for_good() -> None:
    core = Ticks()
    background = Background([core], asynchronous=False)
    assert background.driver is None and not background.running, "nothing before first use"
    background.start()
    background.start()
    assert isinstance(background.driver, BackgroundThread) and background.running
    assert sum(t.name == "pdclient-background" for t in threading.enumerate()) >= 1
    wait_until(lambda: core.applied >= 2)
    thread = background.driver._thread
    background.close()
    assert thread is not None and not thread.is_alive() and background.driver is None
    background.start()
    assert background.driver is None, "closed is closed: no restart"


async def test_async_background_is_a_task_on_the_running_loop() -> None:
    core = Ticks()
    background = Background([core], asynchronous=True)
    background.start()
    driver = background.driver
    assert isinstance(driver, BackgroundTask) and driver.running
    assert [t for t in asyncio.all_tasks() if t.get_name() == "pdclient-background"]
    for _ in range(500):
        if core.applied >= 2:
            break
        await asyncio.sleep(0.01)
    assert core.applied >= 2
    await background.aclose()
    assert not driver.running and not [t for t in asyncio.all_tasks() if t.get_name() == "pdclient-background"]


def test_async_background_follows_a_new_loop() -> None:
    background = Background([Ticks()], asynchronous=True)

    async def use() -> asyncio.Task[None] | None:
        background.start()
        assert isinstance(background.driver, BackgroundTask)
        return background.driver._task

    first = asyncio.run(use())
    second = asyncio.run(use())
    assert first is not None and second is not None and first is not second and first.done()
    background.close()
    assert second.done() or second.cancelled()


def test_async_background_under_trio_is_a_task_of_its_run() -> None:
    trio = pytest.importorskip("trio")
    core = Ticks()
    background = Background([core], asynchronous=True)

    async def use() -> None:
        background.start()
        driver = background.driver
        assert isinstance(driver, BackgroundTask) and background.running
        assert not [t for t in threading.enumerate() if t.name == "pdclient-background"], "no thread under trio"
        with trio.fail_after(5):
            while core.applied < 2:
                await trio.sleep(0.01)
        driver.wake()  # from the run's own thread
        await background.aclose()
        assert not driver.running

    trio.run(use)
    assert background.driver is None


def test_a_trio_run_that_ends_without_aclose_ends_its_task_and_the_next_run_gets_one() -> None:
    trio = pytest.importorskip("trio")
    core = Ticks()
    background = Background([core], asynchronous=True)

    async def use() -> BackgroundTask:
        background.start()
        driver = background.driver
        assert isinstance(driver, BackgroundTask)
        before = core.applied
        with trio.fail_after(5):
            while core.applied < before + 2:
                await trio.sleep(0.01)
        return driver

    first = trio.run(use)
    assert not first.running, "its system task was cancelled with the run"
    assert trio.run(use) is first and not first.running, "the same driver, started again in the new run"
    background.close()


def test_a_fleet_dropped_unclosed_stops_its_thread() -> None:
    fleet = Fleet(options(health_checks=HealthSettings(interval=0.05, timeout=0.05)))
    fleet.start()
    assert fleet.background is not None
    driver = fleet.background.driver
    assert isinstance(driver, BackgroundThread)
    thread = driver._thread
    del fleet
    gc.collect()
    assert thread is not None
    thread.join(5)
    assert not thread.is_alive()
