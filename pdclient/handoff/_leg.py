"""One leg of a call (prefill, decode, or the KV release): the endpoints it tried, its current attempt.

Every way a leg takes an endpoint is here: routed by its pool's policy (``pick``, or
``pick_ahead`` of its attempt), pinned by the call (``pin``, ``take``), or a fixed URL
outside any pool (``use``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import httpx

from ..fleet import request_overrides
from ..pools import Endpoint, EndpointPool, retry
from ..pools import PoolDecision as RouteDecision
from ..routing import RouteRequest

if TYPE_CHECKING:
    from ._call import Call


class Leg:
    """One leg of a call (prefill, decode, or the KV release): endpoints tried, the current attempt.

    Observers see it as a ``LegView`` between ``on_leg_start`` and ``on_leg_end``.
    """

    def __init__(self, call: Call, name: str, pool: EndpointPool | None) -> None:
        self._call = call
        self.name = name
        self.pool = pool
        self.tried: list[Endpoint] = []
        self.endpoint: Endpoint | None = None
        self.decision: RouteDecision | None = None
        self.url = ""
        self.attempt = 0
        self.request: httpx.Request = call.request
        self.sent_at = 0.0
        self.status: int | None = None
        self._open = False
        self._stream: float | None = None
        self._ahead: str | None = None

    def pick(self, route: RouteRequest, exclude: Sequence[Endpoint] = ()) -> str:
        """An admitted endpoint this call has not tried yet if any, never one in ``exclude``
        (those a moved stream broke on); raises ``AllEndpointsOpen``. The one way a leg takes
        a routed endpoint: the policy's ``on_routed``, the trace and the metrics all see it."""
        assert self.pool is not None
        return self.take(self.pool.decide(route, avoid=self.tried, exclude=exclude))

    def pick_ahead(self, route: RouteRequest) -> str:
        """``pick`` before the next attempt is built: a concurrent decode names its prefill's
        endpoint, and that attempt goes there (``next_pick``)."""
        self._ahead = self.pick(route)
        return self._ahead

    def next_pick(self, route: RouteRequest) -> str:
        """The next attempt's endpoint: the one picked ahead of it, or a fresh ``pick``."""
        ahead, self._ahead = self._ahead, None
        return ahead if ahead is not None else self.pick(route)

    def pin(self, url: str, rule: str, policy: str = "conversation") -> str | None:
        """The pool's member at ``url`` if it admits a request now (else None), chosen by the
        call itself: the decode endpoint holding a conversation (``remote_prefill``), or the
        one its rendezvous names (``policy`` ``rendezvous``)."""
        assert self.pool is not None
        for endpoint in self.pool.admitted(exclude=self.tried):
            if endpoint.url == url:
                return self.take(RouteDecision(policy, endpoint, rule=rule))
        return None

    def take(self, decision: RouteDecision) -> str:
        """The endpoint ``decision`` names (the policy's, or the call's own choice, whatever
        its breaker says): acquired, tried, and the leg's from now on."""
        endpoint = decision.endpoint
        endpoint.acquire()
        self.endpoint = endpoint
        self.tried.append(endpoint)
        self.decision = decision
        self.url = endpoint.url
        return endpoint.url

    def use(self, url: str) -> str:
        """A fixed URL outside any pool (the fallback server)."""
        self.endpoint = self.decision = None
        self.url = url
        return url

    def start(self, request: httpx.Request) -> httpx.Request:
        if self.endpoint is not None and self.endpoint.host_name is not None:
            headers, extensions = request_overrides(self.endpoint)  # a discovered address: its DNS name
            request.headers.update(headers)
            request.extensions = {**request.extensions, **extensions}
        self.attempt += 1
        self.request = request
        self.status = None
        self.sent_at = time.perf_counter()
        self._open = True
        self._call.observers.leg_start(self._call, self)
        return request

    def streaming(self) -> None:
        """The attempt's answer has begun: a stream running on its endpoint until it ends."""
        if self.endpoint is not None and self._open and self._stream is None:
            self._stream = self.endpoint.stalls.begin()

    def answered(self, chunks: int = 1) -> None:
        """The answer is whole, in ``chunks`` pieces: the endpoint's latency learns the time per piece."""
        if self.endpoint is not None:
            self.endpoint.latency.observe((time.perf_counter() - self.sent_at) * 1000 / max(1, chunks))

    def end(self, status: int | None, error: BaseException | None) -> None:
        """The attempt is over: free the endpoint (its breaker learns the outcome), tell the observers."""
        if not self._open:
            return
        self._open = False
        self.status = status
        if self.endpoint is not None:
            if self._stream is not None:
                self.endpoint.stalls.end(self._stream)
                self._stream = None
            self.endpoint.release(ok=_health(status, error))
        self._call.observers.leg_end(self._call, self, status, error)


def _health(status: int | None, error: BaseException | None) -> bool | None:
    """What an attempt says of its server: a transport or decoding error counts against it, a cancel does not."""
    if error is not None:
        return False if isinstance(error, httpx.TransportError | httpx.DecodingError) else None
    return retry.counts_against_server(status)
