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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol

from ._endpoint import Chosen, Routed

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
    ``wants_prompt_text`` is true (``routing._cache_aware.prompt_text`` renders it)."""
    tenant: str | None = None
    """Who is calling, as an opaque digest (``pdclient serve`` sets one per API key or per
    the header its operator names; None in process). State a policy keeps per prompt or
    conversation is kept per tenant, so no caller learns of or evicts another's."""
    held_tokens: Mapping[str, int] | None = None
    """How many of the prompt's leading tokens each endpoint holds (by URL), by its own KV
    events: known only for a prompt whose leading ids are (a remembered conversation's),
    and read only by a policy that follows a prefix cache (``CacheAware``); None otherwise."""


@dataclass(frozen=True)
class RouteDecision(Generic[Chosen]):
    """How a leg's endpoint was chosen: for observers (``leg.decision``) and the trace.

    ``str()`` is the trace's compact ASCII form, ``policy[/rule][ name=value ...]``, e.g.
    ``least_outstanding``, ``cache_aware/cache match=1536 prompt=2048``,
    ``load_aware/load score=2``.
    """

    policy: str
    """The policy's name (``least_outstanding``, ``cache_aware``, ...; a custom policy's class name)."""
    endpoint: Chosen
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

    def choose(self, endpoints: Sequence[Routed], request: RouteRequest) -> Routed: ...


def policy_name(policy: object) -> str:
    name = getattr(policy, "name", None)
    return name if isinstance(name, str) else type(policy).__name__


def policy_decision(policy: RoutingPolicy, endpoints: Sequence[Routed], request: RouteRequest) -> RouteDecision[Routed]:
    """The policy's choice among ``endpoints`` with its reason (``decide`` if it has one, else ``choose``)."""
    explained = getattr(policy, "decide", None)
    if explained is not None:
        decision: RouteDecision[Routed] = explained(endpoints, request)
        return decision
    return RouteDecision(policy_name(policy), policy.choose(endpoints, request))
