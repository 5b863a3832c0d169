"""A client's pools and their background work: the sans-I/O cores (load scrapes, health probes,
DNS discovery, prefill warm-ups) and the drivers that run them."""

from ._background import (
    MAX_ANSWER_BYTES,
    Background,
    BackgroundTask,
    BackgroundThread,
    Core,
    Fetch,
    Fetched,
    Job,
    JobResult,
    LookedUp,
    Lookup,
    Resolver,
    fetch,
    host_header,
    running_library,
    system_resolver,
)
from ._coordinates import CoordinateBook, Coordinates
from ._discovery import DiscoverySettings, DnsDiscovery, is_address, members_of, request_overrides
from ._fleet import Fleet
from ._health import HealthProber, HealthSettings, ProbeState, step, verdict
from ._kv_events import KVEventWatch
from ._load import LoadScraper, ScrapeSettings, ServerLoad, parse_metrics, server_url
from ._warm import WARM_UP_LOAD_POLL, WARM_UP_TIMEOUT, PrefillWarmer

__all__ = [
    "KVEventWatch",
    "Background",
    "BackgroundTask",
    "BackgroundThread",
    "CoordinateBook",
    "Coordinates",
    "Core",
    "DiscoverySettings",
    "DnsDiscovery",
    "Fetch",
    "Fetched",
    "Fleet",
    "HealthProber",
    "HealthSettings",
    "Job",
    "LoadScraper",
    "LookedUp",
    "Lookup",
    "MAX_ANSWER_BYTES",
    "JobResult",
    "PrefillWarmer",
    "ProbeState",
    "Resolver",
    "ScrapeSettings",
    "ServerLoad",
    "WARM_UP_LOAD_POLL",
    "WARM_UP_TIMEOUT",
    "fetch",
    "host_header",
    "is_address",
    "members_of",
    "parse_metrics",
    "request_overrides",
    "running_library",
    "server_url",
    "step",
    "system_resolver",
    "verdict",
]
