"""Active health checks: ``GET /health`` on every pool member, feeding its circuit breaker.

Without them a breaker learns only from requests: a dead server costs a failed request
(three, to open), and an open one is retried by a real request after each cool-down.
With them, a probe failure counts as a request failure does (``Endpoint.note_failure``),
``failures`` consecutive probe failures open the breaker whatever requests said
(``Endpoint.trip``; further failures keep restarting its cool-down, so no request is
risked on a server that is still down), and ``successes`` consecutive probe successes
while it is open close it (``Endpoint.reset_breaker``) without waiting for a request to
try. vLLM answers ``/health`` at the server root (beside ``/v1``) with 200, or 503 once
its engine is dead.

The state machine per member, on each probe (``step``)::

    verdict   counters                                   effect on the breaker
    failure   failures += 1, successes = 0               note_failure; trip once failures >= F
    success   failures = 0; successes += 1 if not closed close once successes >= S (then 0)
              (successes = 0 while the breaker is closed)
    unclear   unchanged                                  none (3xx/4xx: e.g. no /health route)

Defaults, against SMG (lightseekorg/smg ``model_gateway/src/main.rs``, health checks:
``--health-failure-threshold 3``, ``--health-success-threshold 2``,
``--health-check-timeout-secs 5``, ``--health-check-interval-secs 60``, endpoint
``/health``; its state machine in ``worker/manager.rs::compute_next_status``): the same
thresholds, 3 and 2. SMG probes each worker once a minute from one gateway; a client
probes every 5 s, the breaker's own cool-down (``BreakerSettings.cooldown``), so recovery
by probe is never slower than recovery by a request, and gives a probe 2 s (a vLLM
``/health`` is a constant answer from the API server; slower than that, it is in
trouble). The 2 s bound the whole probe, its answer's last byte included, and probes run
concurrently: a server that hangs or drips its answer fails at its own deadline and
delays no other member's probe (``fleet._background``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from .._durations import check_seconds
from .._errors import PDConfigError
from ..pools import Endpoint
from ._background import Fetched, Job, JobResult, check_count
from ._load import EndpointPoller

logger = logging.getLogger("pdclient")

Effect = Literal["note_failure", "trip", "close"]


@dataclass(frozen=True)
class HealthSettings:
    """How a pool's members are probed (defaults: see the module docstring)."""

    interval: float = 5.0
    """Seconds between two probes of one server."""
    timeout: float = 2.0
    """Seconds one probe may take, its whole answer included; longer is a failure."""
    failures: int = 3
    """Consecutive probe failures that open the breaker."""
    successes: int = 2
    """Consecutive probe successes that close an open breaker."""
    path: str = "/health"
    """From the server root (vLLM serves it beside /v1, not under it)."""

    def __post_init__(self) -> None:
        check_seconds("HealthSettings.interval", self.interval)
        check_seconds("HealthSettings.timeout", self.timeout)
        check_count("HealthSettings", "failures", self.failures)
        check_count("HealthSettings", "successes", self.successes)
        if not (isinstance(self.path, str) and self.path.startswith("/")):
            raise PDConfigError(f"HealthSettings.path must start with '/', got {self.path!r}")


@dataclass(frozen=True)
class ProbeState:
    """One member's probe counters."""

    failures: int = 0
    """Consecutive failed probes."""
    successes: int = 0
    """Consecutive good probes while the breaker was not closed."""


def verdict(outcome: JobResult) -> bool | None:
    """True: healthy; False: not (no answer, 5xx); None: the answer says nothing (3xx, 4xx)."""
    if not isinstance(outcome, Fetched) or outcome.status is None:
        return False
    if outcome.ok:
        return True
    return False if outcome.status >= 500 else None


def step(
    state: ProbeState, healthy: bool | None, breaker_closed: bool, settings: HealthSettings
) -> tuple[ProbeState, tuple[Effect, ...]]:
    """The next counters and what to do to the breaker, for one probe's verdict."""
    if healthy is None:
        return state, ()
    if healthy is False:
        failures = state.failures + 1
        effects: tuple[Effect, ...] = ("note_failure", "trip") if failures >= settings.failures else ("note_failure",)
        return ProbeState(failures=failures, successes=0), effects
    if breaker_closed:
        return ProbeState(), ()
    successes = state.successes + 1
    if successes >= settings.successes:
        return ProbeState(), ("close",)
    return replace(state, failures=0, successes=successes), ()


class HealthProber(EndpointPoller):
    """Sans-I/O core: probes every member of a pool and applies ``step`` to its breaker."""

    def __init__(
        self, members: Callable[[], Sequence[Endpoint]], settings: HealthSettings | None = None, *, leg: str = "pool"
    ) -> None:
        self.settings = settings = settings or HealthSettings()
        super().__init__(members, interval=settings.interval, path=settings.path, timeout=settings.timeout, leg=leg)
        self._states: weakref.WeakKeyDictionary[Endpoint, ProbeState] = weakref.WeakKeyDictionary()
        self._unclear: weakref.WeakSet[Endpoint] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"HealthProber({self._leg}, {self.settings})"

    def state(self, endpoint: Endpoint) -> ProbeState:
        return self._states.get(endpoint, ProbeState())

    def apply(self, job: Job, outcome: JobResult, now: float) -> None:
        endpoint = self._answered(job)
        healthy = verdict(outcome)
        if healthy is None and endpoint not in self._unclear:
            self._unclear.add(endpoint)
            status = outcome.status if isinstance(outcome, Fetched) else None
            logger.warning("pdclient: %s %s answered HTTP %s; its probes say nothing", self._leg, job.action, status)
        state, effects = step(self.state(endpoint), healthy, endpoint.state == "closed", self.settings)
        self._states[endpoint] = state
        for effect in effects:
            if effect == "note_failure":
                endpoint.note_failure()
            elif effect == "trip":
                if state.failures == self.settings.failures:  # log the transition, not every probe after it
                    problem = getattr(outcome, "error", None) or f"HTTP {getattr(outcome, 'status', '?')}"
                    logger.warning(
                        "pdclient: %s %s failed %d health probes in a row (%s); breaker open until it passes again",
                        self._leg,
                        endpoint.url,
                        state.failures,
                        problem,
                    )
                endpoint.trip()
            else:
                logger.info("pdclient: %s %s passes its health probes again; breaker closed", self._leg, endpoint.url)
                endpoint.reset_breaker()
