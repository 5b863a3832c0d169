"""Routing policies, circuit breakers and retry decisions, without HTTP."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence

import httpx
import pytest

from pdclient import PDConfigError, PDOptions
from pdclient.pools import (
    AllEndpointsOpen,
    BreakerSettings,
    Endpoint,
    EndpointPool,
    counts_against_server,
    is_transient_status,
    retry_after_seconds,
    route_decision,
)
from pdclient.routing import Affinity, LeastOutstanding, PowerOfTwoChoices, RoundRobin, RouteRequest, make_policy
from tests.clock import Clock

URLS = ("http://a/v1", "http://b/v1", "http://c/v1")


def pool(policy: object = None, failures: int = 2, cooldown: float = 10.0) -> tuple[EndpointPool, Clock]:
    clock = Clock()
    policy = make_policy(policy or "least_outstanding")  # type: ignore[arg-type]
    return EndpointPool("decode", URLS, policy, BreakerSettings(failures, cooldown), clock), clock


def test_round_robin_takes_turns() -> None:
    p, _ = pool(RoundRobin())
    assert [p.decide(RouteRequest("decode")).endpoint.url for _ in range(4)] == [*URLS, URLS[0]]


def test_least_outstanding_takes_the_idlest() -> None:
    p, _ = pool(LeastOutstanding())
    a, b, _c = p.endpoints
    a.acquire()
    b.acquire()
    assert p.decide(RouteRequest("decode")).endpoint.url == URLS[2]
    a.release(ok=True)
    assert p.decide(RouteRequest("decode")).endpoint.url == URLS[0]


def test_power_of_two_never_takes_the_busiest_of_its_two() -> None:
    p, _ = pool(PowerOfTwoChoices(random.Random(7)))
    busy = p.endpoints[0]
    for _ in range(5):
        busy.acquire()
    picks = Counter(p.decide(RouteRequest("decode")).endpoint.url for _ in range(300))
    assert URLS[0] not in picks and set(picks) == {URLS[1], URLS[2]}


def test_affinity_is_stable_and_spreads_keys() -> None:
    p, _ = pool(Affinity())
    chosen = {f"k{i}": p.decide(RouteRequest("decode", f"k{i}")).endpoint.url for i in range(60)}
    assert all(p.decide(RouteRequest("decode", k)).endpoint.url == url for k, url in chosen.items())
    assert set(chosen.values()) == set(URLS)


def test_affinity_moves_only_the_keys_of_a_down_endpoint() -> None:
    p, _ = pool(Affinity(), failures=1)
    before = {f"k{i}": p.decide(RouteRequest("decode", f"k{i}")).endpoint.url for i in range(60)}
    down = p.endpoints[0]
    down.acquire()
    down.release(ok=False)
    after = {k: p.decide(RouteRequest("decode", k)).endpoint.url for k in before}
    assert all(after[k] == url for k, url in before.items() if url != down.url)
    assert down.url not in after.values()


def test_pick_avoids_endpoints_already_tried_when_it_can() -> None:
    p, _ = pool(LeastOutstanding())
    assert p.decide(RouteRequest("decode"), avoid=p.endpoints[:2]).endpoint.url == URLS[2]
    assert p.decide(RouteRequest("decode"), avoid=p.endpoints).endpoint.url == URLS[0], "all tried: any admitted one"


def test_breaker_opens_after_consecutive_failures_and_half_opens_for_one_probe() -> None:
    p, clock = pool(RoundRobin(), failures=2, cooldown=10)
    a = p.endpoints[0]
    for ok in (False, True, False):
        a.acquire()
        a.release(ok=ok)
    assert a.state == "closed", "a success resets the count"
    a.acquire()
    a.release(ok=False)
    assert a.state == "open" and not a.admits()
    clock.now = 10
    assert a.state == "half-open" and a.admits()
    a.acquire()
    assert not a.admits(), "one probe at a time"
    a.release(ok=False)
    assert a.state == "open", "a failed probe opens it again"
    clock.now = 20
    a.acquire()
    a.release(ok=True)
    assert a.state == "closed" and a.admits()


def test_busy_answers_do_not_trip_the_breaker() -> None:
    p, _ = pool(failures=1)
    a = p.endpoints[0]
    a.acquire()
    a.release(ok=None)
    assert a.state == "closed"


def test_all_open_names_every_endpoint() -> None:
    p, _ = pool(failures=1)
    for endpoint in p.endpoints:
        endpoint.acquire()
        endpoint.release(ok=False)
    with pytest.raises(AllEndpointsOpen, match=r"every decode endpoint .* http://a/v1 \(open\), http://b/v1 \(open\)"):
        p.decide(RouteRequest("decode"))


def test_unknown_policy_is_a_config_error() -> None:
    with pytest.raises(PDConfigError, match="routing must be one of"):
        PDOptions("http://p/v1", "http://d/v1", routing="fastest")
    with pytest.raises(PDConfigError, match="routing must be one of"):
        PDOptions("http://p/v1", "http://d/v1", routing=42)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("status", "transient", "health"),
    [
        (200, False, True),
        (400, False, True),
        (404, False, True),
        (408, True, None),
        (429, True, None),
        (500, True, False),
        (502, True, False),
        (503, True, False),
        (504, True, False),
        (None, None, False),
    ],
)
def test_status_decisions(status: int | None, transient: bool | None, health: bool | None) -> None:
    if status is not None:
        assert is_transient_status(status) is transient
    assert counts_against_server(status) is health


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({}, None),
        ({"retry-after": "2"}, 2.0),
        ({"retry-after": "0.5"}, 0.5),
        ({"retry-after": "999"}, 10.0),
        ({"retry-after-ms": "250"}, 0.25),
        ({"retry-after": "soon"}, None),
        # Out of range, as the openai SDK reads them: ignored (the backoff applies), never slept on.
        ({"retry-after": "-3"}, None),
        ({"retry-after-ms": "-1"}, None),
        ({"retry-after-ms": "nan"}, None),
        ({"retry-after": "inf"}, None),
        ({"retry-after-ms": "nan", "retry-after": "1"}, 1.0),
    ],
)
def test_retry_after(headers: dict[str, str], seconds: float | None) -> None:
    assert retry_after_seconds(httpx.Response(429, headers=headers)) == seconds


def test_retry_after_http_date() -> None:
    import email.utils
    import time

    when = email.utils.formatdate(time.time() + 3, usegmt=True)
    value = retry_after_seconds(httpx.Response(503, headers={"retry-after": when}))
    assert value is not None and 1.5 < value <= 3.0


# -- the interfaces issue 12 builds on ------------------------------------------------


def test_route_gives_the_policy_a_request_and_tells_it_the_choice() -> None:
    class Recording:
        def __init__(self) -> None:
            self.seen: list[tuple[list[str], RouteRequest]] = []
            self.routed: list[tuple[str, RouteRequest]] = []

        def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
            self.seen.append(([e.url for e in endpoints], request))
            return endpoints[-1]

        def on_routed(self, endpoint: Endpoint, request: RouteRequest) -> None:
            self.routed.append((endpoint.url, request))

    p, _ = pool()
    policy = Recording()
    request = RouteRequest("prefill", affinity_key="k", prompt_text="<|user|>hi")
    assert route_decision(p, policy, request, avoid=p.endpoints[2:]).endpoint.url == URLS[1]
    assert policy.seen == [(list(URLS[:2]), request)]
    assert policy.routed == [(URLS[1], request)]


def test_probe_verdicts_feed_the_breaker() -> None:
    p, clock = pool(failures=2, cooldown=10)
    a = p.endpoints[0]
    a.note_failure()
    assert a.state == "closed" and a.in_flight == 0
    a.acquire()
    a.release(ok=False)
    assert a.state == "open", "a probe failure and a request failure add up"
    a.reset_breaker()
    assert a.state == "closed"
    a.trip()
    assert a.state == "open"
    clock.now = 9
    a.trip()
    clock.now = 12
    assert a.state == "open", "trip() restarts the cool-down"
    clock.now = 19
    assert a.state == "half-open"


def test_set_members_keeps_survivors_and_leaves_removed_ones_to_their_calls() -> None:
    p, _ = pool()
    a, b, c = p.endpoints
    b.acquire()
    added, removed = p.set_members([(URLS[0], None), ("http://10.0.0.4/v1", "svc"), (URLS[2], None)])
    assert [e.url for e in removed] == [URLS[1]] and [e.url for e in added] == ["http://10.0.0.4/v1"]
    assert p.endpoints[0] is a and p.endpoints[2] is c and p.endpoints[1].host_name == "svc"
    assert all(p.decide(RouteRequest("decode")).endpoint.url != URLS[1] for _ in range(5))
    b.release(ok=True)  # the call that held it ends normally
    assert b.in_flight == 0
    assert p.urls == URLS, "what the caller configured does not change"
    with pytest.raises(ValueError):
        p.set_members([])


def test_a_named_policys_legs_and_load_signals_are_its_class_attributes(monkeypatch: pytest.MonkeyPatch) -> None:
    """One source of a policy's metadata: the name resolves to the class, the class says."""
    from pdclient.routing import CacheAware, LoadAware, legs_of, wants_load_signals

    assert legs_of("cache_aware") == ("prefill",) and wants_load_signals("load_aware")
    monkeypatch.setattr(CacheAware, "legs", ("prefill", "decode"))
    monkeypatch.setattr(LoadAware, "wants_load_signals", False)
    assert legs_of("cache_aware") == ("prefill", "decode")
    assert not wants_load_signals("load_aware")


def test_the_pool_says_which_endpoints_admit_now() -> None:
    """One question, one answer: the members whose breaker admits a request now, less those excluded."""
    p, _ = pool(failures=1)
    a, b, c = p.endpoints
    a.acquire()
    a.release(ok=False)
    assert p.admitted() == [b, c]
    assert p.admitted(exclude=[c]) == [b]
    assert p.candidates(exclude=[c]) == [b]
