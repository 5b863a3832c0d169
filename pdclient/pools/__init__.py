"""The endpoints of each leg: ``EndpointPool``, ``Endpoint`` (breaker, in-flight count, latency
estimate, ``StallLedger`` of its running streams), URL handling, and the retry decisions per
leg (``retry``: the leg retry loops and their policies, used as a namespace)."""

from . import _retry as retry
from ._endpoints import (
    DECODE_ENV,
    PREFILL_ENV,
    AllEndpointsOpen,
    BreakerSettings,
    Endpoint,
    EndpointPool,
    PoolDecision,
    URLArg,
    resolve_urls,
    route_decision,
)
from ._latency import PeakEWMA
from ._retry import RetrySettings, Sleep, counts_against_server, is_transient_status, retry_after_seconds
from ._stalls import StallLedger

__all__ = [
    "AllEndpointsOpen",
    "BreakerSettings",
    "DECODE_ENV",
    "Endpoint",
    "EndpointPool",
    "PREFILL_ENV",
    "PeakEWMA",
    "PoolDecision",
    "RetrySettings",
    "Sleep",
    "StallLedger",
    "URLArg",
    "counts_against_server",
    "is_transient_status",
    "resolve_urls",
    "retry",
    "retry_after_seconds",
    "route_decision",
]
