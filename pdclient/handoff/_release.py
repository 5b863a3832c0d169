"""The KV release: a one-token decode that frees an abandoned handoff's KV blocks on its prefill server.

A handoff abandoned after its prefill and before any decode request could have reached a
server (a cancel, Ctrl-C, no decode endpoint reachable) leaves the prefill's blocks held
until a decode pulls them or the connector's lease ends (minutes). A release pulls them at
once; it is never sent when the decode request may have reached its server (that would be
a second pull). A moved stream's continuation prefill is released the same way
(``_move``), through the same builder (``release_leg``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import httpx

from ..pools import AllEndpointsOpen
from ..routing import RouteDecision
from ._leg import Leg

if TYPE_CHECKING:
    from ._call import Call

RELEASE_TIMEOUT = 10.0
"""Bounds a release: a caller that is going away (Ctrl-C, a cancelled task) waits at most this long."""

_RELEASE_TIMEOUTS = dict.fromkeys(("connect", "read", "write", "pool"), RELEASE_TIMEOUT)


def release_request(call: Call) -> tuple[Leg, httpx.Request] | None:
    """The release of ``call``'s prefill KV, when the handoff was abandoned before any decode
    request could have reached a server (never a second pull); None otherwise."""
    plan, result = call.plan, call.prefill_result
    if plan is None or result is None or not result.holds_remote_kv:
        return None
    if call.fallback_url is not None or call.decode_may_have_reached:
        return None
    assert call.dialect is not None
    return release_leg(call, call.dialect.release_body(plan, result))


def release_leg(call: Call, content: bytes, request_id: str | None = None) -> tuple[Leg, httpx.Request] | None:
    """A release leg of ``call`` sending ``content`` (a release body, under ``request_id`` if
    given, else the call's) to a decode endpoint; None when no endpoint is worth a try.

    Every release is built here, so every one is bounded and routed alike:

    - Its timeouts are ``RELEASE_TIMEOUT``, never the caller's: a release goes out while its
      caller is leaving (an exception, a cancel), and the caller's read timeout (openai's
      default is 10 minutes) would hold it that long on an unresponsive server.
    - It is routed as the decode leg is. When every breaker is open it still gets one try,
      on the endpoint with the fewest requests in flight among those this call's decode leg
      did not try: the prefill server holds the blocks until a decode pulls them or the
      connector's lease ends (minutes), and a refused connection costs nothing. An endpoint
      that failed this very call is never tried again: with none left, the blocks expire
      with the lease.
    """
    pool = call.context.fleet.decode
    leg = Leg(call, "release", pool)
    try:
        base = leg.pick(call.route_for("decode"))
    except AllEndpointsOpen:
        untried = [e for e in pool.endpoints if e not in call.decode.tried]
        if not untried:
            return None
        endpoint = min(untried, key=lambda e: e.in_flight)
        base = leg.take(RouteDecision("release", endpoint, rule="breaker_open"))
    request = call.requests.signed(base, content)
    if request_id is not None:
        request.headers["x-request-id"] = request_id
    request.extensions = {**request.extensions, "timeout": _RELEASE_TIMEOUTS}
    return leg, leg.start(request)
