"""Endpoint pools: where each leg goes, which member is healthy, and who is busy.

A pool holds one leg's endpoints (prefill or decode). Choosing a member is two steps:
the circuit breakers drop the members that failed recently, then a routing policy
(``routing._policy``) picks among the rest.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeAlias

import httpx

from .._durations import check_seconds
from .._errors import PDConfigError, PDError
from ..routing import LeastOutstanding, LoadSample, RouteDecision, RouteRequest, RoutingPolicy, policy_decision
from ..wire import normalise_url, redact_url
from ._latency import PeakEWMA
from ._stalls import StallLedger

PREFILL_ENV = "PDCLIENT_PREFILL_BASE_URL"
DECODE_ENV = "PDCLIENT_DECODE_BASE_URL"

URLArg = str | httpx.URL | Sequence[str | httpx.URL] | None


def resolve_urls(value: URLArg, *, argument: str, env: str) -> tuple[str, ...]:
    """Normalise one URL or a list of URLs, falling back to a comma-separated env var."""
    source = argument
    if value is None:
        raw = os.environ.get(env, "")
        value = [part for part in (p.strip() for p in raw.split(",")) if part]
        source = f"{argument} (from ${env})"
        if not value:
            raise PDConfigError(f"{argument} is required: pass it, or set ${env} (comma-separated URLs)")
    items = [value] if isinstance(value, str | httpx.URL) else list(value)
    if not items:
        raise PDConfigError(f"{source} is an empty list; give at least one URL")
    urls = tuple(normalise_url(item, source) for item in items)
    if len(set(urls)) != len(urls):
        raise PDConfigError(f"{source} lists the same URL twice: {[redact_url(u) for u in urls]}")
    return urls


class AllEndpointsOpen(PDError):
    """Every endpoint of a pool has its circuit breaker open (internal: the caller gets a 503)."""


@dataclass(frozen=True)
class BreakerSettings:
    """Open after ``failures`` consecutive failures; let one probe through after ``cooldown`` s."""

    failures: int = 3
    cooldown: float = 5.0

    def __post_init__(self) -> None:
        if not (isinstance(self.failures, int) and self.failures >= 1):
            raise PDConfigError(f"breaker.failures must be an int >= 1, got {self.failures!r}")
        check_seconds("breaker.cooldown", self.cooldown, zero=True)


class Endpoint:
    """One server of a pool: its URL, its in-flight count and its circuit breaker."""

    def __init__(
        self, url: str, breaker: BreakerSettings, clock: Callable[[], float], *, host_name: str | None = None
    ) -> None:
        self.url = url
        self.host_name = host_name
        """When ``url`` holds one address of a DNS name (discovery): the name, for the Host header and TLS SNI."""
        self.in_flight = 0
        self.stalls = StallLedger()
        """Of ``in_flight``, the calls whose answer has begun to arrive (``Leg.streaming``):
        the streams a decode-only turn's prefill here would stall, and what the turns admitted
        while they ran were predicted to stall them. A call still waiting for its first token
        (its KV on the way, or queued) would only start later."""
        self.load: LoadSample | None = None
        """The server's own load as its last /metrics scrape said (``fleet._load.LoadScraper`` writes it)."""
        self.latency = PeakEWMA(clock=clock)
        """How fast it answered this process's calls (``Leg.answered`` feeds it; see ``pools._latency``)."""
        self._breaker = breaker
        self._clock = clock
        self._failures = 0
        self._opened_at: float | None = None
        self._probing = False
        self._idle_waiters: list[Callable[[], object]] = []
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Endpoint({redact_url(self.url)!r}, in_flight={self.in_flight}, state={self.state})"

    @property
    def state(self) -> str:
        if self._opened_at is None:
            return "closed"
        return "half-open" if self._clock() - self._opened_at >= self._breaker.cooldown else "open"

    def admits(self) -> bool:
        """Whether a request may go here now; in half-open state only one probe at a time."""
        state = self.state
        return state == "closed" or (state == "half-open" and not self._probing)

    def acquire(self) -> None:
        with self._lock:
            self.in_flight += 1
            if self.state == "half-open":
                self._probing = True

    @property
    def streaming(self) -> int:
        """The streams running here (``stalls.running``)."""
        return self.stalls.running

    def release(self, *, ok: bool | None) -> None:
        """End one request; ``ok`` None means it says nothing of the server's health."""
        with self._lock:
            self.in_flight -= 1
            self._probing = False
            if ok is True:
                self._failures = 0
                self._opened_at = None
            elif ok is False:
                self._count_failure()
            waiters: list[Callable[[], object]] = []
            if self.in_flight <= 0:
                waiters, self._idle_waiters = self._idle_waiters, []
        for waiter in waiters:
            waiter()

    def when_idle(self, callback: Callable[[], object]) -> None:
        """Call ``callback`` once, when no request of this process is in flight here: at once
        if none is, else on the release of the last (from the releasing thread; once however
        often it was asked for meanwhile)."""
        with self._lock:
            if self.in_flight > 0:
                if callback not in self._idle_waiters:
                    self._idle_waiters.append(callback)
                return
        callback()

    def note_failure(self) -> None:
        """A failure seen outside a request (a health probe): it counts as a failed request does."""
        with self._lock:
            self._count_failure()

    def trip(self) -> None:
        """Open the breaker now, or restart its cool-down: the server is known to be down."""
        with self._lock:
            self._opened_at = self._clock()

    def reset_breaker(self) -> None:
        """Close the breaker: the server is known to be back."""
        with self._lock:
            self._failures = 0
            self._opened_at = None

    def _count_failure(self) -> None:
        self._failures += 1
        if self._failures >= self._breaker.failures or self._opened_at is not None:
            self._opened_at = self._clock()


PoolDecision: TypeAlias = RouteDecision[Endpoint]
"""A pool's routing decision: the policy's reason, naming one of the pool's own endpoints."""


@dataclass(eq=False)
class EndpointPool:
    """The endpoints of one leg with their routing policy and breakers."""

    leg: str
    urls: tuple[str, ...]
    policy: RoutingPolicy = field(default_factory=LeastOutstanding)
    breaker: BreakerSettings = field(default_factory=BreakerSettings)
    clock: Callable[[], float] = time.monotonic
    endpoints: tuple[Endpoint, ...] = field(init=False)
    _membership: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        self.endpoints = tuple(Endpoint(url, self.breaker, self.clock) for url in self.urls)

    def set_members(self, members: Sequence[tuple[str, str | None]]) -> tuple[list[Endpoint], list[Endpoint]]:
        """Make the pool's members these ``(url, host_name)``; returns (added, removed).

        A member that stays keeps its Endpoint (breaker, in-flight count, load). A removed
        one leaves the pool, not the calls that hold it: they finish on it and release it
        as usual; the policy's ``on_removed`` (if any) is told, so it can forget it.
        ``urls`` (what the caller configured) does not change.
        """
        wanted = dict(members)
        if not wanted:
            raise ValueError(f"a {self.leg} pool needs at least one member")
        with self._membership:
            current = {e.url: e for e in self.endpoints}
            endpoints = tuple(
                current.get(url) or Endpoint(url, self.breaker, self.clock, host_name=name)
                for url, name in wanted.items()
            )
            added = [e for e in endpoints if e.url not in current]
            removed = [e for e in self.endpoints if e.url not in wanted]
            self.endpoints = endpoints  # one assignment: decide() sees the old or the new tuple
        on_removed = getattr(self.policy, "on_removed", None)
        if on_removed is not None:
            for endpoint in removed:
                on_removed(endpoint)
        return added, removed

    def decide(
        self, request: RouteRequest, avoid: Sequence[Endpoint] = (), exclude: Sequence[Endpoint] = ()
    ) -> PoolDecision:
        """An admitted endpoint chosen by the pool's policy (preferring ones not in ``avoid``, tried
        by this call; never one in ``exclude``), with the policy's reason."""
        return route_decision(self, self.policy, request, avoid, exclude)

    def admitted(self, exclude: Sequence[Endpoint] = (), members: Sequence[Endpoint] | None = None) -> list[Endpoint]:
        """The members whose breaker admits a request now, never one in ``exclude``."""
        return [e for e in (self.endpoints if members is None else members) if e.admits() and e not in exclude]

    def candidates(self, avoid: Sequence[Endpoint] = (), exclude: Sequence[Endpoint] = ()) -> list[Endpoint]:
        """The admitted endpoints not in ``avoid`` (all admitted ones if that leaves none), never
        one in ``exclude``; raises ``AllEndpointsOpen`` when none is left."""
        members = self.endpoints  # read once: discovery may swap the tuple meanwhile
        admitted = self.admitted(exclude, members)
        if not admitted:
            if exclude:
                raise AllEndpointsOpen(f"no other {self.leg} endpoint is admitted")
            states = ", ".join(f"{redact_url(e.url)} ({e.state})" for e in members)
            raise AllEndpointsOpen(f"every {self.leg} endpoint has its circuit breaker open: {states}")
        fresh = [e for e in admitted if e not in avoid]
        return fresh or admitted

    def base_of(self, url: str) -> str | None:
        """The pool URL that ``url`` lies under, if any."""
        for base in self.urls:
            if url == base or url.startswith(base + "/"):
                return base
        return None


def route_decision(
    pool: EndpointPool,
    policy: RoutingPolicy,
    request: RouteRequest,
    avoid: Sequence[Endpoint] = (),
    exclude: Sequence[Endpoint] = (),
) -> PoolDecision:
    """Choose among the pool's candidates with ``policy``, then tell the policy (its optional
    ``on_routed``); the choice with its reason."""
    decision = policy_decision(policy, pool.candidates(avoid, exclude), request)
    on_routed = getattr(policy, "on_routed", None)
    if on_routed is not None:
        on_routed(decision.endpoint, request)
    return decision
