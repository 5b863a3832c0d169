"""Routing policies: which admitted endpoint of a pool takes a leg.

A policy is a small object with ``choose(endpoints, request)``; the pool hands it the
members its circuit breakers admit (never empty) and a ``RouteRequest`` describing the
leg. Pass your own as ``routing=`` (anything with that method).

Every choice becomes a ``RouteDecision``: the policy's name, the endpoint and, for the
policies that weigh several rules (affinity, load-aware, cache-aware), which rule decided
and the numbers behind it. Observers read it as ``leg.decision``; the trace carries it as
``prefill_route`` / ``decode_route`` (``str(decision)``).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ._endpoints import Endpoint


TENANT_EXTENSION = "pdclient.tenant"
"""The httpx request extension that names the caller's tenant (``RouteRequest.tenant``):
set by a server that passes many callers' requests on (``pdclient serve``), never read
from anything a caller sends."""


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
    tenant: str | None = None
    """Who is calling, as an opaque digest (``pdclient serve`` sets one per API key or per
    the header its operator names; None in process). State a policy keeps per prompt or
    conversation is kept per tenant, so no caller learns of or evicts another's."""


@dataclass(frozen=True)
class RouteDecision:
    """How a leg's endpoint was chosen: for observers (``leg.decision``) and the trace.

    ``str()`` is the trace's compact ASCII form, ``policy[/rule][ name=value ...]``, e.g.
    ``least_outstanding``, ``cache_aware/cache match=1536 prompt=2048``,
    ``load_aware/load score=2``.
    """

    policy: str
    """The policy's name (``least_outstanding``, ``cache_aware``, ...; a custom policy's class name)."""
    endpoint: Endpoint
    rule: str | None = None
    """Which of the policy's rules decided, for policies that have several:
    ``affinity``: ``key`` / ``no_key`` (least outstanding);
    ``load_aware``: ``load`` (the servers' scraped counts) / ``stale`` (no fresh sample: least outstanding);
    ``cache_aware``: ``cache`` / ``balance`` / ``affinity`` / ``least_loaded`` (see ``CacheAware``)."""
    detail: Mapping[str, float] = field(default_factory=dict)
    """The numbers behind the rule: ``match`` / ``prompt`` (characters of the prompt the
    chosen server holds / of the prompt), ``score`` (the chosen server's load score),
    ``low`` / ``high`` (the pool's least and most load), ``full`` (servers skipped for a full KV cache)."""

    def __str__(self) -> str:
        text = self.policy if self.rule is None else f"{self.policy}/{self.rule}"
        return " ".join([text, *(f"{name}={value:g}" for name, value in self.detail.items())])


class RoutingPolicy(Protocol):
    """Chooses one of the admitted endpoints (never empty) for a leg.

    Optional extras, found with ``getattr``:

    - ``decide(endpoints, request) -> RouteDecision``: the choice with its reason (used
      instead of ``choose`` when present);
    - ``on_routed(endpoint, request)``: told the choice once it is made (e.g. to remember
      where a prompt went);
    - ``on_removed(endpoint)``: told when discovery removes a member from the pool;
    - ``wants_prompt_text = True``: to be given ``RouteRequest.prompt_text``;
    - ``wants_load_signals = True``: the pool's servers' ``/metrics`` are scraped for it
      (``Endpoint.load``) even when ``load_signals`` is left at its default;
    - ``legs = ("prefill",)``: the legs it can route (default: both);
    - ``name``: its name in ``RouteDecision`` (default: the class name).
    """

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint: ...


def policy_name(policy: object) -> str:
    name = getattr(policy, "name", None)
    return name if isinstance(name, str) else type(policy).__name__


def decide(policy: RoutingPolicy, endpoints: Sequence[Endpoint], request: RouteRequest) -> RouteDecision:
    """The policy's choice among ``endpoints`` with its reason (``decide`` if it has one, else ``choose``)."""
    explained = getattr(policy, "decide", None)
    if explained is not None:
        decision: RouteDecision = explained(endpoints, request)
        return decision
    return RouteDecision(policy_name(policy), policy.choose(endpoints, request))


def rendezvous(endpoints: Sequence[Endpoint], key: str) -> Endpoint:
    """The endpoint that ranks first for ``key`` (rendezvous hashing): a key moves only when its endpoint goes."""
    return max(endpoints, key=lambda e: hashlib.blake2b(f"{key}|{e.url}".encode(), digest_size=8).digest())


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
        # next() on itertools.count is atomic under the GIL: safe across threads and tasks.
        return endpoints[next(self._turn) % len(endpoints)]


class LeastOutstanding:
    """The endpoint with the fewest requests in flight from this client (ties: first listed)."""

    name = "least_outstanding"

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
        return min(endpoints, key=lambda e: e.in_flight)


class PowerOfTwoChoices:
    """Two endpoints at random, the less busy one: near least-outstanding, no herding."""

    name = "power_of_two"

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

    name = "affinity"

    def __init__(self, fallback: RoutingPolicy | None = None) -> None:
        self._fallback = fallback or LeastOutstanding()

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
        return self.decide(endpoints, request).endpoint

    def decide(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> RouteDecision:
        if request.affinity_key is None:
            return RouteDecision(self.name, self._fallback.choose(endpoints, request), "no_key")
        return RouteDecision(self.name, rendezvous(endpoints, request.affinity_key), "key")


def _load_aware(load_signals: bool) -> RoutingPolicy:
    from ._load import LoadAware  # _load imports this module

    return LoadAware()


def _cache_aware(load_signals: bool) -> RoutingPolicy:
    from ._load import LoadAware
    from ._prefix_index import CacheAware

    return CacheAware(load=LoadAware() if load_signals else None)


POLICIES: dict[str, Callable[[bool], RoutingPolicy]] = {
    "round_robin": lambda load_signals: RoundRobin(),
    "least_outstanding": lambda load_signals: LeastOutstanding(),
    "power_of_two": lambda load_signals: PowerOfTwoChoices(),
    "affinity": lambda load_signals: Affinity(),
    "load_aware": _load_aware,
    "cache_aware": _cache_aware,
}
"""The policies ``routing=`` names; each factory takes whether the pool's /metrics are scraped."""

LOAD_POLICIES = frozenset({"load_aware"})
"""Named policies that read the servers' load: they turn load signals on for their pool."""
PREFILL_ONLY = frozenset({"cache_aware"})
"""Named policies that route the prefill leg only (they follow the prefill servers' prefix caches)."""


def legs_of(value: str | RoutingPolicy) -> tuple[str, ...]:
    """The legs a policy (by name or object) can route."""
    if isinstance(value, str):
        return ("prefill",) if value in PREFILL_ONLY else ("prefill", "decode")
    legs = getattr(value, "legs", ("prefill", "decode"))
    return tuple(legs)


def wants_load_signals(value: str | RoutingPolicy) -> bool:
    """Whether a policy (by name or object) reads ``Endpoint.load``, so its pool must be scraped."""
    if isinstance(value, str):
        return value in LOAD_POLICIES
    return bool(getattr(value, "wants_load_signals", False))


def make_policy(value: str | RoutingPolicy, *, load_signals: bool = False) -> RoutingPolicy:
    """A fresh policy object for one pool (policies may keep state, e.g. round robin's turn).

    ``load_signals``: the pool's servers are scraped, so a policy that can use their load
    (cache-aware's balance rule) is given it.
    """
    return POLICIES[value](load_signals) if isinstance(value, str) else value
