"""The KV release: a one-token decode that frees an abandoned handoff's KV blocks on its prefill server.

A handoff abandoned after its prefill and before any decode request could have reached a
server (a cancel, Ctrl-C, no decode endpoint reachable) leaves the prefill's blocks held
until a decode pulls them or the connector's lease ends (minutes). A release pulls them at
once; it is never sent when the decode request may have reached its server (that would be
a second pull).
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


def release_request(call: Call) -> tuple[Leg, httpx.Request] | None:
    """The release of ``call``'s prefill KV, when the handoff was abandoned before any decode
    request could have reached a server (never a second pull); None otherwise."""
    plan, result = call.plan, call.prefill_result
    if plan is None or result is None or not result.holds_remote_kv:
        return None
    if call.fallback_url is not None or call.decode_may_have_reached:
        return None
    pool = call.context.fleet.decode
    leg = Leg(call, "release", pool)
    try:
        base = leg.pick(call.route_for("decode"))
    except AllEndpointsOpen:
        # Every breaker is open, yet the prefill server holds the blocks until a decode
        # pulls them or the connector's lease ends (minutes): one try is worth it (a
        # refused connection costs nothing), on an endpoint the decode leg did not try.
        untried = [e for e in pool.endpoints if e not in call.decode.tried]
        if not untried:
            return None  # each failed this very call: the blocks expire with the lease
        endpoint = min(untried, key=lambda e: e.in_flight)
        base = leg.take(RouteDecision("release", endpoint, rule="breaker_open"))
    assert call.dialect is not None
    request = call.requests.signed(base, call.dialect.release_body(plan, result))
    request.extensions = {
        **request.extensions,
        "timeout": dict.fromkeys(("connect", "read", "write", "pool"), RELEASE_TIMEOUT),
    }
    return leg, leg.start(request)
