"""What a routing policy reads of an endpoint, and the load sample it weighs.

The endpoints themselves (breaker, in-flight count, latency estimate) are ``pools.Endpoint``;
the samples are written by ``fleet._load.LoadScraper``. Both packages sit above this one, so
what the three share is here: a policy is written against ``EndpointView`` and hands back the
very object it was given (``Routed``), so the pool's caller gets its own endpoint type back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from typing_extensions import TypeVar


@dataclass(frozen=True)
class LoadSample:
    """One scrape of one server, as the scraper leaves it on ``Endpoint.load``."""

    waiting: float
    running: float
    kv_usage: float | None
    taken_at: float
    """Clock time (``time.monotonic``) the answer arrived."""
    fresh_until: float
    """After this the sample says nothing: routing falls back to this process's own view."""
    local_in_flight: int
    """This process's calls in flight on the endpoint when the answer arrived (the
    server's counts include them): the difference from the current count is what the
    server has got from us since."""

    def fresh(self, now: float) -> bool:
        return now < self.fresh_until


class LatencyEstimate(Protocol):
    """How fast an endpoint has been answering (``pools.PeakEWMA``)."""

    def estimate(self) -> float | None: ...


class EndpointView(Protocol):
    """What a policy may read of an endpoint."""

    @property
    def url(self) -> str: ...

    @property
    def in_flight(self) -> int:
        """This process's calls in flight on it."""

    @property
    def load(self) -> LoadSample | None:
        """The server's own counts at its last scrape (None when not scraped)."""

    @property
    def latency(self) -> LatencyEstimate: ...


Routed = TypeVar("Routed", bound=EndpointView)
"""The endpoint type a policy routes among; it returns one of the objects it was given."""
Chosen = TypeVar("Chosen", bound=EndpointView, default=EndpointView, covariant=True)
"""The endpoint type a ``RouteDecision`` names (any ``EndpointView`` where left open)."""
