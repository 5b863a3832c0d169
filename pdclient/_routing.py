"""Routing policies: which admitted endpoint of a pool takes a leg.

A policy is a small object with ``choose(endpoints, request)``; the pool hands it the
members its circuit breakers admit (never empty) and a ``RouteRequest`` describing the
leg. Pass your own as ``routing=`` (anything with that method).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ._endpoints import Endpoint


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know of the leg it routes."""

    leg: str
    """``prefill`` or ``decode``."""
    affinity_key: str | None = None
    """The conversation's key (its opening messages, or the caller's session key)."""
    prompt_text: str | None = None
    """The chat messages' text, role-tagged, in order; computed only for a policy whose
    ``wants_prompt_text`` is true (``_prefix_index.prompt_text`` renders it)."""


class RoutingPolicy(Protocol):
    """Chooses one of the admitted endpoints (never empty) for a leg.

    A policy may also have ``on_routed(endpoint, request)``, called once the choice is
    made (e.g. to remember where a prompt went), and ``wants_prompt_text = True`` to be
    given ``RouteRequest.prompt_text``.
    """

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint: ...


def rendezvous(endpoints: Sequence[Endpoint], key: str) -> Endpoint:
    """The endpoint that ranks first for ``key`` (rendezvous hashing): a key moves only when its endpoint goes."""
    return max(endpoints, key=lambda e: hashlib.blake2b(f"{key}|{e.url}".encode(), digest_size=8).digest())


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
        # next() on itertools.count is atomic under the GIL: safe across threads and tasks.
        return endpoints[next(self._turn) % len(endpoints)]


class LeastOutstanding:
    """The endpoint with the fewest requests in flight from this client (ties: first listed)."""

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
        return min(endpoints, key=lambda e: e.in_flight)


class PowerOfTwoChoices:
    """Two endpoints at random, the less busy one: near least-outstanding, no herding."""

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
        if len(endpoints) == 1:
            return endpoints[0]
        first, second = self._rng.sample(list(endpoints), 2)
        return first if first.in_flight <= second.in_flight else second


class Affinity:
    """The same conversation (or session key) goes to the same endpoint, so its prefix cache is reused.

    Rendezvous hashing: each key ranks the endpoints by hash; the best admitted one wins,
    so a key moves only when its endpoint is down. Requests without a key use ``fallback``.
    """

    def __init__(self, fallback: RoutingPolicy | None = None) -> None:
        self._fallback = fallback or LeastOutstanding()

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
        if request.affinity_key is None:
            return self._fallback.choose(endpoints, request)
        return rendezvous(endpoints, request.affinity_key)


POLICIES: dict[str, Callable[[], RoutingPolicy]] = {
    "round_robin": RoundRobin,
    "least_outstanding": LeastOutstanding,
    "power_of_two": PowerOfTwoChoices,
    "affinity": Affinity,
}


def make_policy(value: str | RoutingPolicy) -> RoutingPolicy:
    """A fresh policy object for one pool (policies may keep state, e.g. round robin's turn)."""
    return POLICIES[value]() if isinstance(value, str) else value
