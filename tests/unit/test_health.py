"""Active health checks: the probe state machine and its effect on endpoint breakers."""

from __future__ import annotations

import logging

import pytest

from pdclient import PDConfigError
from pdclient.fleet import Fetch, Fetched, HealthProber, HealthSettings, LookedUp, ProbeState, step, verdict
from pdclient.pools import BreakerSettings, EndpointPool
from pdclient.routing import LeastOutstanding, RouteRequest
from tests.clock import Clock

SETTINGS = HealthSettings(failures=3, successes=2)
UP, DOWN, UNCLEAR = Fetched(200), Fetched(503, "engine dead"), Fetched(404)
GONE = Fetched(None, error="ConnectError: refused")


@pytest.mark.parametrize(
    ("outcome", "expected"),
    [
        (Fetched(200), True),
        (Fetched(204), True),
        (Fetched(503), False),
        (Fetched(500), False),
        (GONE, False),
        (Fetched(404), None),
        (Fetched(401), None),
        (Fetched(302), None),
        (LookedUp(), False),
    ],
)
def test_verdicts(outcome: Fetched, expected: bool | None) -> None:
    assert verdict(outcome) is expected


@pytest.mark.parametrize(
    ("state", "healthy", "closed", "next_state", "effects"),
    [
        # failures count, and the third opens the breaker (and every one after restarts its cool-down)
        (ProbeState(), False, True, ProbeState(1, 0), ("note_failure",)),
        (ProbeState(1, 0), False, True, ProbeState(2, 0), ("note_failure",)),
        (ProbeState(2, 0), False, True, ProbeState(3, 0), ("note_failure", "trip")),
        (ProbeState(3, 0), False, False, ProbeState(4, 0), ("note_failure", "trip")),
        # a failure ends a run of successes
        (ProbeState(0, 1), False, False, ProbeState(1, 0), ("note_failure",)),
        # successes while the breaker is open or half-open: the second closes it
        (ProbeState(4, 0), True, False, ProbeState(0, 1), ()),
        (ProbeState(0, 1), True, False, ProbeState(), ("close",)),
        # successes while it is closed only clear the counters
        (ProbeState(2, 0), True, True, ProbeState(), ()),
        (ProbeState(), True, True, ProbeState(), ()),
        # an unclear answer changes nothing
        (ProbeState(2, 1), None, False, ProbeState(2, 1), ()),
    ],
)
def test_step(
    state: ProbeState, healthy: bool | None, closed: bool, next_state: ProbeState, effects: tuple[str, ...]
) -> None:
    assert step(state, healthy, closed, SETTINGS) == (next_state, effects)


def test_one_success_threshold_closes_at_once() -> None:
    assert step(ProbeState(5, 0), True, False, HealthSettings(successes=1)) == (ProbeState(), ("close",))


def setup(failures: int = 3) -> tuple[EndpointPool, HealthProber, Clock]:
    clock = Clock()
    pool = EndpointPool(
        "prefill", ("http://a:8000/v1", "http://b:8000/v1"), LeastOutstanding(), BreakerSettings(failures, 5.0), clock
    )
    return pool, HealthProber(lambda: pool.endpoints, HealthSettings(interval=1.0), leg="prefill"), clock


def probe(prober: HealthProber, clock: Clock, outcome: Fetched, *, only: str = "http://a:8000/v1") -> None:
    for job in prober.due(clock.now):
        prober.apply(job, outcome if job.key.url == only else UP, clock.now)  # type: ignore[attr-defined]
    clock.now += 1.0


def test_probes_go_to_the_server_root() -> None:
    _, prober, _ = setup()
    assert [j.action for j in prober.due(0.0)] == [
        Fetch("http://a:8000/health", 2.0),
        Fetch("http://b:8000/health", 2.0),
    ]


def test_a_dead_server_is_kept_out_until_it_passes_probes_again(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "pdclient")
    pool, prober, clock = setup(failures=10)  # requests alone would need 10 failures
    a = pool.endpoints[0]
    for _ in range(3):
        probe(prober, clock, DOWN)
    assert a.state == "open" and not a.admits()
    for _ in range(8):  # longer than the 5 s cool-down: every failed probe restarts it
        probe(prober, clock, GONE)
        assert a.state == "open"
    assert pool.decide(RouteRequest("prefill")).endpoint.url == "http://b:8000/v1"
    probe(prober, clock, UP)
    assert a.state == "open", "one success is not enough"
    probe(prober, clock, UP)
    assert a.state == "closed" and a.admits()
    messages = [r.getMessage() for r in caplog.records]
    assert sum("failed 3 health probes" in m for m in messages) == 1
    assert sum("passes its health probes again" in m for m in messages) == 1


def test_probe_failures_and_request_failures_add_up() -> None:
    pool, prober, clock = setup(failures=3)
    a = pool.endpoints[0]
    a.acquire()
    a.release(ok=False)
    a.acquire()
    a.release(ok=False)
    probe(prober, clock, GONE)
    assert a.state == "open", "2 request failures + 1 probe failure"


def test_good_probes_do_not_excuse_failing_requests() -> None:
    pool, prober, clock = setup(failures=3)
    a = pool.endpoints[0]
    for _ in range(3):
        a.acquire()
        a.release(ok=False)
        probe(prober, clock, UP)
    assert a.state == "open", "a 200 on /health says nothing of the request path while the breaker is closed"


def test_probes_close_a_breaker_that_requests_opened() -> None:
    pool, prober, clock = setup(failures=1)
    a = pool.endpoints[0]
    a.acquire()
    a.release(ok=False)
    assert a.state == "open"
    probe(prober, clock, UP)
    probe(prober, clock, UP)
    assert a.state == "closed", "2 s after opening, before the 5 s cool-down"


def test_unclear_answers_are_ignored_and_said_once(caplog: pytest.LogCaptureFixture) -> None:
    pool, prober, clock = setup(failures=1)
    for _ in range(5):
        probe(prober, clock, UNCLEAR)
    assert pool.endpoints[0].state == "closed"
    assert sum("its probes say nothing" in r.getMessage() for r in caplog.records) == 1


def test_bad_settings() -> None:
    with pytest.raises(PDConfigError):
        HealthSettings(failures=0)
    with pytest.raises(PDConfigError):
        HealthSettings(interval=0)
