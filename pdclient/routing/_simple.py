"""The simple policies: round robin, least outstanding, power of two choices, affinity."""

from __future__ import annotations

import itertools
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._endpoint import Routed
from ._policy import RouteDecision
from ._rendezvous import rendezvous

if TYPE_CHECKING:
    from ._policy import RouteRequest, RoutingPolicy


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, endpoints: Sequence[Routed], request: RouteRequest) -> Routed:
        # next() on itertools.count is atomic under the GIL: safe across threads and tasks.
        return endpoints[next(self._turn) % len(endpoints)]


class LeastOutstanding:
    """The endpoint with the fewest requests in flight from this client (ties: first listed)."""

    name = "least_outstanding"

    def choose(self, endpoints: Sequence[Routed], request: RouteRequest) -> Routed:
        return min(endpoints, key=lambda e: e.in_flight)


class PowerOfTwoChoices:
    """Two endpoints at random, the less busy one: near least-outstanding, no herding."""

    name = "power_of_two"

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, endpoints: Sequence[Routed], request: RouteRequest) -> Routed:
        if len(endpoints) == 1:
            return endpoints[0]
        first, second = self._rng.sample(list(endpoints), 2)
        return first if first.in_flight <= second.in_flight else second


class Affinity:
    """The same conversation (or session key) goes to the same endpoint, so its prefix cache is reused.

    Rendezvous hashing: each key ranks the endpoints by hash; the best admitted one wins,
    so a key moves only when its endpoint is down. Requests without a key use ``fallback``.
    """

    name = "affinity"

    def __init__(self, fallback: RoutingPolicy | None = None) -> None:
        self._fallback = fallback or LeastOutstanding()

    def choose(self, endpoints: Sequence[Routed], request: RouteRequest) -> Routed:
        return self.decide(endpoints, request).endpoint

    def decide(self, endpoints: Sequence[Routed], request: RouteRequest) -> RouteDecision[Routed]:
        if request.affinity_key is None:
            return RouteDecision(self.name, self._fallback.choose(endpoints, request), "no_key")
        return RouteDecision(self.name, rendezvous(endpoints, request.affinity_key), "key")
