"""Rendezvous routing with a load bound: the same choice in every process, spread over the pool.

A conversation (its affinity key, within its tenant) ranks the admitted endpoints by a
hash of the key and each endpoint's URL (highest random weight); the first in that order
whose load is not well above the pool's mean takes it. Every replica and worker that sees
the conversation computes the same ranking from the request alone, so its turns meet the
prefix cache that holds it without any shared state, and different conversations spread
over the pool as their hashes do (the least-outstanding rule sends sequential calls all to
the first endpoint). An endpoint that leaves moves only its own keys.

The bound (consistent hashing with bounded loads, Mirrokni et al.): an endpoint is passed
over when its load exceeds ``max(bound x mean, mean + slack)``. Loads are the servers'
scraped counts when every endpoint has a fresh sample (``LoadAware.loads``), else this
process's outstanding requests. ``slack`` keeps a pool of mostly idle servers from moving
a conversation for one or two requests: with one in flight on three endpoints the mean is
a third, and any bound on the ratio alone would move it.

``RouteDecision.rule``: ``key`` (the key's first endpoint), ``bounded`` (passed over
``rank`` more loaded ones), ``no_key`` (no key: least loaded).

``PrefixRendezvous`` (``"prefix_rendezvous"``) keys the same rule on the prompt's opening
text (its first ``prefix_chars`` characters, role-tagged, within the tenant) instead of
the conversation: calls that share a long system prompt or document meet on one
endpoint's prefix cache in every replica, with no index of what was sent where
(``CacheAware`` keeps one per process). For the prefill leg.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from .._errors import PDConfigError
from ._endpoint import Routed
from ._load_aware import LoadAware
from ._policy import RouteDecision

if TYPE_CHECKING:
    from ._policy import RouteRequest


def rendezvous_order(endpoints: Sequence[Routed], key: str) -> list[int]:
    """The endpoints' indices, best first, for ``key`` (highest random weight)."""
    weights = [hashlib.blake2b(f"{key}|{e.url}".encode(), digest_size=8).digest() for e in endpoints]
    return sorted(range(len(endpoints)), key=lambda i: weights[i], reverse=True)


def rendezvous(endpoints: Sequence[Routed], key: str) -> Routed:
    """The endpoint that ranks first for ``key``: a key moves only when its endpoint goes."""
    return endpoints[rendezvous_order(endpoints, key)[0]]


def tenant_key(key: str, tenant: str | None) -> str:
    """A key within its tenant: the same conversation text of two tenants ranks apart."""
    return key if tenant is None else f"{tenant}\x00{key}"


class Rendezvous:
    """The key's highest-ranked endpoint whose load is not well above the pool's mean."""

    name = "rendezvous"
    wants_prompt_text = False
    wants_load_signals = False

    def __init__(self, *, bound: float = 1.5, slack: float = 2.0) -> None:
        if not bound >= 1.0 or not slack >= 0.0:
            raise PDConfigError(f"Rendezvous: bound must be >= 1 and slack >= 0, got {bound!r}, {slack!r}")
        self.bound = bound
        self.slack = slack
        self._load = LoadAware(latency=False)

    def choose(self, endpoints: Sequence[Routed], request: RouteRequest) -> Routed:
        return self.decide(endpoints, request).endpoint

    def key(self, request: RouteRequest) -> str | None:
        """What the ranking hashes: the conversation's affinity key, within its tenant."""
        return None if request.affinity_key is None else tenant_key(request.affinity_key, request.tenant)

    def decide(self, endpoints: Sequence[Routed], request: RouteRequest) -> RouteDecision[Routed]:
        loads = self._load.loads(endpoints)
        key = self.key(request)
        if key is None:
            best = min(range(len(endpoints)), key=lambda i: loads[i])
            return RouteDecision(self.name, endpoints[best], "no_key")
        order = rendezvous_order(endpoints, key)
        mean = sum(loads) / len(loads)
        limit = max(self.bound * mean, mean + self.slack)
        for rank, index in enumerate(order):
            if loads[index] <= limit:
                if rank == 0:
                    return RouteDecision(self.name, endpoints[index], "key")
                return RouteDecision(self.name, endpoints[index], "bounded", {"rank": rank})
        return RouteDecision(self.name, endpoints[order[0]], "key")  # unreachable: the least loaded is <= mean


class PrefixRendezvous(Rendezvous):
    """``Rendezvous`` on the prompt's opening text: a shared prefix meets on one endpoint in every process."""

    name = "prefix_rendezvous"
    wants_prompt_text = True

    def __init__(self, *, prefix_chars: int = 1024, bound: float = 1.5, slack: float = 2.0) -> None:
        if isinstance(prefix_chars, bool) or not isinstance(prefix_chars, int) or prefix_chars < 1:
            raise PDConfigError(f"PrefixRendezvous: prefix_chars must be an int >= 1, got {prefix_chars!r}")
        super().__init__(bound=bound, slack=slack)
        self.prefix_chars = prefix_chars

    def key(self, request: RouteRequest) -> str | None:
        if not request.prompt_text:
            return None
        return tenant_key(request.prompt_text[: self.prefix_chars], request.tenant)


_CONVERSATIONS = Rendezvous()


def conversation_routing(decode_policy: object, *, chosen: bool) -> Rendezvous | None:
    """The policy that places conversations on decode endpoints, or None to leave that to the
    decode leg's own policy.

    The decode pool's own when it is a ``Rendezvous`` (its bound); the default one when the
    decode leg's policy was not chosen (``chosen`` false: the default least-outstanding, which
    would send sequential conversations all to the first endpoint); None for a policy the
    caller chose. Stateless, so every process places a conversation alike."""
    if isinstance(decode_policy, Rendezvous):
        return decode_policy
    return None if chosen else _CONVERSATIONS
