"""``/ready``: each endpoint's breaker and health probe, and whether a chat call can be
answered now; the first round of probes the app waits for before it serves."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from .. import AsyncPDTransport
from ..fleet import Fleet, HealthProber
from ..pools import Endpoint
from ..wire import redact_url


def health_probers(fleet: Fleet) -> list[HealthProber]:
    background = fleet.background
    return [core for core in background.cores if isinstance(core, HealthProber)] if background is not None else []


def _probe(endpoint: Endpoint, probers: list[HealthProber]) -> str | None:
    """What the health checks last said of ``endpoint``: ``failing`` from its first failed
    probe on, ``ok`` otherwise; None without health checks."""
    if not probers:
        return None
    return "failing" if any(prober.state(endpoint).failures for prober in probers) else "ok"


def readiness(transport: AsyncPDTransport, requires_prefill: bool = False) -> dict[str, Any]:
    """``/ready``'s body: each endpoint's breaker (and health probe), and whether a chat call
    can be answered now.

    A decode endpoint must be up: admitted by its breaker and, with health checks on, not
    failing its last probe (the breaker opens only after several failed probes, so that
    one lost probe does not take a server out of routing; the readinessProbe has its own
    threshold to smooth one). A prefill endpoint must be up too when the failure policy is
    ``fail`` (every call would fail without one) or ``requires_prefill`` is set; with
    ``decode`` (the default) or a fallback URL the proxy still answers every call, without
    the handoff, so it stays ready and says ``degraded``. Taking every replica of a proxy
    out of its load balancer because the shared prefill pool is down would turn a slower
    answer into no answer.
    """
    body: dict[str, Any] = {"ready": False, "degraded": False, "prefill": [], "decode": []}
    probers = health_probers(transport.fleet)
    up = {"prefill": False, "decode": False}
    for pool in transport.fleet.pools:
        for e in pool.endpoints:
            admitted, probe = e.admits(), _probe(e, probers)
            state = {"url": redact_url(e.url), "state": e.state, "admitted": admitted, "in_flight": e.in_flight}
            if probe is not None:
                state["probe"] = probe
            body[pool.leg].append(state)
            up[pool.leg] = up[pool.leg] or (admitted and probe != "failing")
    prefill_up, decode_up = up["prefill"], up["decode"]
    policy = transport.options.on_prefill_failure
    if prefill_up:
        body["ready"] = decode_up
    elif requires_prefill or policy == "fail":
        body["ready"] = False
    else:  # decode-only, or the fallback server (outside the pools: its health is not tracked)
        body["ready"] = decode_up or policy != "decode"
        body["degraded"] = body["ready"]
    return body


async def first_probes(fleet: Fleet) -> None:
    """With health checks on, wait until the first round of probes is in (at most a probe's
    timeout), so that the first /ready already says what they found: the server opens its
    listener once the lifespan has started, not before."""
    probers = health_probers(fleet)
    if not probers:
        return
    deadline = time.monotonic() + max(prober.settings.timeout for prober in probers) + 0.5
    # A prober's next_due is 0 while a member waits for its first probe, infinite while
    # every member's is out, and the next round's time once they are in. (Polled: the
    # cores are plain state, with nothing to wait on.)
    while not all(0.0 < p.next_due() < math.inf for p in probers) and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
