"""Which endpoint takes a leg: the ``RoutingPolicy`` protocol and its records, what a policy
reads of an endpoint (``EndpointView``, ``LoadSample``), one module per policy, and the
registry of the names ``routing=`` takes."""

from ._cache_aware import DEFAULT_MAX_CHARS, CacheAware, PrefixIndex, plan_text, prompt_text
from ._endpoint import EndpointView, LatencyEstimate, LoadSample
from ._load_aware import LoadAware
from ._policy import TENANT_EXTENSION, RouteDecision, RouteRequest, RoutingPolicy, policy_decision
from ._registry import POLICIES, legs_of, make_policy, prefill_only, wants_load_signals
from ._rendezvous import PrefixRendezvous, Rendezvous, conversation_routing, rendezvous_order, tenant_key
from ._simple import Affinity, LeastOutstanding, PowerOfTwoChoices, RoundRobin

__all__ = [
    "Affinity",
    "CacheAware",
    "DEFAULT_MAX_CHARS",
    "EndpointView",
    "LatencyEstimate",
    "LeastOutstanding",
    "LoadAware",
    "LoadSample",
    "POLICIES",
    "PowerOfTwoChoices",
    "PrefixRendezvous",
    "PrefixIndex",
    "Rendezvous",
    "RoundRobin",
    "RouteDecision",
    "RouteRequest",
    "RoutingPolicy",
    "TENANT_EXTENSION",
    "policy_decision",
    "prefill_only",
    "conversation_routing",
    "legs_of",
    "make_policy",
    "plan_text",
    "prompt_text",
    "rendezvous_order",
    "tenant_key",
    "wants_load_signals",
]
