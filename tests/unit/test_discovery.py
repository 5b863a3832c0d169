"""DNS discovery: members from a name's addresses, and how the pool follows them."""

from __future__ import annotations

import pytest

from pdclient import PDConfigError
from pdclient.fleet import (
    DiscoverySettings,
    DnsDiscovery,
    Fetch,
    HealthProber,
    LoadScraper,
    LookedUp,
    Lookup,
    is_address,
    members_of,
    request_overrides,
)
from pdclient.pools import BreakerSettings, Endpoint, EndpointPool
from pdclient.routing import LeastOutstanding, RouteRequest

NAME = "http://vllm-decode.ns.svc:8000/v1"


def test_members_of_a_name_keep_scheme_port_and_path() -> None:
    assert members_of(NAME, ("10.0.0.1", "fd00::2")) == [
        ("http://10.0.0.1:8000/v1", "vllm-decode.ns.svc"),
        ("http://[fd00::2]:8000/v1", "vllm-decode.ns.svc"),
    ]
    assert members_of("https://vllm.example/api/v1", ("10.0.0.1",)) == [("https://10.0.0.1/api/v1", "vllm.example")]
    assert members_of(NAME, None) == [(NAME, None)], "not resolved yet: the name itself"
    assert members_of("http://10.9.9.9:8000/v1", ("10.0.0.1",)) == [("http://10.9.9.9:8000/v1", None)]
    assert is_address("fd00::1") and is_address("127.0.0.2") and not is_address("localhost")


def test_request_overrides_present_the_name() -> None:
    clock = lambda: 0.0  # noqa: E731
    plain = Endpoint("http://10.0.0.1:8000/v1", BreakerSettings(), clock)
    assert request_overrides(plain) == ({}, {})
    http = Endpoint("http://10.0.0.1:8000/v1", BreakerSettings(), clock, host_name="vllm.svc")
    assert request_overrides(http) == ({"host": "vllm.svc:8000"}, {})
    tls = Endpoint("https://10.0.0.1/v1", BreakerSettings(), clock, host_name="vllm.example")
    assert request_overrides(tls) == ({"host": "vllm.example"}, {"sni_hostname": "vllm.example"})


def make(*urls: str) -> tuple[EndpointPool, DnsDiscovery, list[tuple[list[str], list[str]]]]:
    pool = EndpointPool("decode", urls or (NAME,), LeastOutstanding(), BreakerSettings(), lambda: 0.0)
    changes: list[tuple[list[str], list[str]]] = []

    # The membership changes DnsDiscovery makes, as the pool sees them.
    def on_change(a, r):
        changes.append(([e.url for e in a], [e.url for e in r]))

    set_members = pool.set_members

    def recording(members):
        added, removed = set_members(members)
        if added or removed:
            on_change(added, removed)
        return added, removed

    pool.set_members = recording
    discovery = DnsDiscovery(pool, DiscoverySettings(interval=10.0))
    return pool, discovery, changes


def resolve(discovery: DnsDiscovery, now: float, *answers: tuple[str, ...] | str) -> None:
    jobs = discovery.due(now)
    assert len(jobs) == len(answers)
    for job, answer in zip(jobs, answers, strict=True):
        outcome = LookedUp(error=answer) if isinstance(answer, str) else LookedUp(answer)
        discovery.apply(job, outcome, now)


def urls(pool: EndpointPool) -> list[str]:
    return [e.url for e in pool.endpoints]


def test_a_name_becomes_its_addresses_and_follows_them() -> None:
    pool, discovery, changes = make()
    assert urls(pool) == [NAME]
    jobs = discovery.due(0.0)
    assert [j.action for j in jobs] == [Lookup("vllm-decode.ns.svc", 8000)]
    assert discovery.due(0.0) == [] and discovery.next_due() == float("inf"), "one lookup at a time"
    discovery.apply(jobs[0], LookedUp(("127.0.0.2", "127.0.0.3")), 0.0)
    assert urls(pool) == ["http://127.0.0.2:8000/v1", "http://127.0.0.3:8000/v1"]
    assert all(e.host_name == "vllm-decode.ns.svc" for e in pool.endpoints)
    assert changes == [(["http://127.0.0.2:8000/v1", "http://127.0.0.3:8000/v1"], [NAME])]
    assert discovery.next_due() == 10.0 and discovery.due(5.0) == []

    kept = pool.endpoints[1]
    gone = pool.endpoints[0]
    gone.acquire()  # a call holds it
    resolve(discovery, 10.0, ("127.0.0.3", "127.0.0.4"))
    assert urls(pool) == ["http://127.0.0.3:8000/v1", "http://127.0.0.4:8000/v1"]
    assert pool.endpoints[0] is kept, "a member that stays keeps its state"
    assert changes[-1] == (["http://127.0.0.4:8000/v1"], ["http://127.0.0.2:8000/v1"])
    gone.release(ok=True)  # the call ends normally on the removed member
    assert gone.in_flight == 0 and all(pool.decide(RouteRequest("decode")).endpoint is not gone for _ in range(4))

    resolve(discovery, 20.0, ("127.0.0.4", "127.0.0.3"))
    assert len(changes) == 2, "the same set in another order is no change"


def test_failed_or_empty_lookups_keep_the_members(caplog: pytest.LogCaptureFixture) -> None:
    pool, discovery, _ = make()
    resolve(discovery, 0.0, "gaierror: Name or service not known")
    assert urls(pool) == [NAME], "never resolved: the name stays"
    resolve(discovery, 10.0, ("127.0.0.2",))
    resolve(discovery, 20.0, ())
    resolve(discovery, 30.0, "timeout")
    assert urls(pool) == ["http://127.0.0.2:8000/v1"]
    warnings = [r.getMessage() for r in caplog.records if "DNS lookup" in r.getMessage()]
    assert len(warnings) == 2, "once per failing spell"


def test_addresses_and_several_names_in_one_pool() -> None:
    other = "https://vllm-b.ns.svc/v1"
    pool, discovery, _ = make("http://10.9.9.9:8000/v1", NAME, other)
    jobs = discovery.due(0.0)
    assert [j.action for j in jobs] == [Lookup("vllm-decode.ns.svc", 8000), Lookup("vllm-b.ns.svc", 443)]
    discovery.apply(jobs[1], LookedUp(("10.0.1.1",)), 0.0)
    assert urls(pool) == ["http://10.9.9.9:8000/v1", NAME, "https://10.0.1.1/v1"]
    discovery.apply(jobs[0], LookedUp(("10.0.0.1", "10.0.0.2")), 0.0)
    assert urls(pool) == [
        "http://10.9.9.9:8000/v1",
        "http://10.0.0.1:8000/v1",
        "http://10.0.0.2:8000/v1",
        "https://10.0.1.1/v1",
    ]
    assert pool.urls == ("http://10.9.9.9:8000/v1", NAME, other), "the configured URLs stay"


def test_a_pool_of_addresses_needs_no_lookups() -> None:
    _, discovery, _ = make("http://10.0.0.1:8000/v1")
    assert discovery.due(0.0) == [] and discovery.next_due() == float("inf")


def test_scraper_and_prober_follow_discovered_members_with_their_name() -> None:
    pool, discovery, _ = make()
    scraper = LoadScraper(lambda: pool.endpoints)
    prober = HealthProber(lambda: pool.endpoints)
    assert [j.action for j in scraper.due(0.0)] == [Fetch("http://vllm-decode.ns.svc:8000/metrics", 1.0)]
    resolve(discovery, 0.0, ("127.0.0.2",))
    assert [j.action for j in scraper.due(0.0)] == [
        Fetch("http://127.0.0.2:8000/metrics", 1.0, host="vllm-decode.ns.svc")
    ]
    assert [j.action for j in prober.due(0.0)] == [
        Fetch("http://127.0.0.2:8000/health", 2.0, host="vllm-decode.ns.svc")
    ]


def test_bad_settings() -> None:
    with pytest.raises(PDConfigError):
        DiscoverySettings(interval=0)
