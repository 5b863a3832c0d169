"""The policies ``routing=`` names, and what a policy (by name or object) needs: its legs, load signals."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from ._cache_aware import CacheAware
from ._load_aware import LoadAware
from ._rendezvous import PrefixRendezvous, Rendezvous
from ._simple import Affinity, LeastOutstanding, PowerOfTwoChoices, RoundRobin

if TYPE_CHECKING:
    from ._policy import RoutingPolicy


def _load_aware(load_signals: bool) -> RoutingPolicy:
    return LoadAware()


def _cache_aware(load_signals: bool) -> RoutingPolicy:
    return CacheAware(load=LoadAware() if load_signals else None)


POLICIES: dict[str, Callable[[bool], RoutingPolicy]] = {
    "round_robin": lambda load_signals: RoundRobin(),
    "least_outstanding": lambda load_signals: LeastOutstanding(),
    "power_of_two": lambda load_signals: PowerOfTwoChoices(),
    "affinity": lambda load_signals: Affinity(),
    "load_aware": _load_aware,
    "cache_aware": _cache_aware,
    "rendezvous": lambda load_signals: Rendezvous(),
    "prefix_rendezvous": lambda load_signals: PrefixRendezvous(),
}
"""The policies ``routing=`` names; each factory takes whether the pool's /metrics are scraped."""


def _policy_of(value: str | RoutingPolicy) -> object:
    """The policy a name makes by default (without load signals), or the object itself: what a
    named policy needs is said once, by its own attributes."""
    if isinstance(value, str):
        factory = POLICIES.get(value)
        return factory(False) if factory is not None else None
    return value


def legs_of(value: str | RoutingPolicy) -> tuple[str, ...]:
    """The legs a policy (by name or object) can route."""
    source = _policy_of(value)
    return tuple(getattr(source, "legs", ("prefill", "decode")))


def wants_load_signals(value: str | RoutingPolicy) -> bool:
    """Whether a policy (by name or object) reads ``Endpoint.load``, so its pool must be scraped."""
    source = _policy_of(value)
    return bool(getattr(source, "wants_load_signals", False))


def prefill_only() -> frozenset[str]:
    """The named policies that route the prefill leg only (they follow the prefill servers' prefix caches)."""
    return frozenset(name for name in POLICIES if legs_of(name) == ("prefill",))


def make_policy(value: str | RoutingPolicy, *, load_signals: bool = False) -> RoutingPolicy:
    """A fresh policy object for one pool (policies may keep state, e.g. round robin's turn).

    ``load_signals``: the pool's servers are scraped, so a policy that can use their load
    (cache-aware's balance rule) is given it.
    """
    return POLICIES[value](load_signals) if isinstance(value, str) else value
