"""The fleet a client talks to: its prefill and decode pools, shared by the client's copies.

Made from the options that shape routing (the URLs, the routing policies, the breaker
settings, the background features); a copy of a client whose options differ only
elsewhere shares its fleet, so endpoint health, load and in-flight counts are one view
per fleet, as openai copies share their connection pool.

The fleet also owns the background work of its pools (load scrapes, health probes, DNS
discovery; ``fleet._background.Background``): none when those features are off, else one
driver started on the first call and stopped by ``close()`` / ``aclose()``. Prefill
warm-ups (``fleet._warm``) get a driver of their own, made when the first one is queued.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Protocol

import httpx

from ..conversations import ConversationMemory, ConversationSettings
from ..costs import CostModel
from ..kv_events import KVEventFeeds
from ..pools import BreakerSettings, Endpoint, EndpointPool
from ..routing import RoutingPolicy, make_policy
from ._background import Background, Core, Fetch, HTTPClient, TransportClient, system_resolver
from ._coordinates import CoordinateBook
from ._discovery import DiscoverySettings, DnsDiscovery, is_address
from ._health import HealthProber, HealthSettings
from ._kv_events import KVEventWatch
from ._load import LoadScraper, ScrapeSettings
from ._warm import WARM_UP_MAX_SLEEP, PrefillWarmer

_FLEET_FIELDS = (
    "prefill_base_url",
    "decode_base_url",
    "routing",
    "breaker",
    "prefill_routing",
    "decode_routing",
    "load_signals",
    "health_checks",
    "discovery",
    "conversations",
    "kv_events",
)


class FleetOptions(Protocol):
    """What a fleet is made from: the options that shape routing (``PDOptions`` has them all).

    Every name in ``_FLEET_FIELDS`` is read too, to tell whether two options share a fleet."""

    @property
    def prefill_urls(self) -> tuple[str, ...]: ...

    @property
    def decode_urls(self) -> tuple[str, ...]: ...

    @property
    def breaker(self) -> BreakerSettings: ...

    @property
    def conversations(self) -> ConversationSettings: ...

    @property
    def discovery(self) -> DiscoverySettings | bool | None: ...

    @property
    def health_checks(self) -> HealthSettings | bool | None: ...

    @property
    def kv_events(self) -> str | int | None: ...

    def policy_for(self, leg: str) -> str | RoutingPolicy: ...

    def load_settings_for(self, leg: str) -> ScrapeSettings | None: ...


class Fleet:
    def __init__(self, options: FleetOptions, *, asynchronous: bool = False) -> None:
        self._key = tuple(getattr(options, name) for name in _FLEET_FIELDS)
        # Each pool gets its own policy object: policies may keep state (round robin's turn).
        self.prefill = EndpointPool("prefill", options.prefill_urls, _policy(options, "prefill"), options.breaker)
        self.decode = EndpointPool("decode", options.decode_urls, _policy(options, "decode"), options.breaker)
        self.coordinates = CoordinateBook()
        """Each prefill endpoint's NIXL coordinates, from its last answer (concurrent dispatch)."""
        self.memory = ConversationMemory(options.conversations)
        """The conversations this fleet's decode endpoints answered (``remote_prefill="auto"``)."""
        self.kv_events = KVEventFeeds() if options.kv_events else None
        """Each endpoint's KV index, from its server's events (``PDOptions.kv_events``)."""
        self.costs = CostModel()
        """What each route costs, learnt from this fleet's calls (``auto``'s decisions)."""
        self.background = _background(options, self.pools, asynchronous, self.kv_events)
        """The pools' background work, or None when no feature needs any."""
        if self.background is not None:  # a client dropped unclosed does not leave its driver running
            weakref.finalize(self, self.background.close, wait=False).atexit = False
        if self.kv_events is not None:
            weakref.finalize(self, self.kv_events.close).atexit = False
        self.warmer = PrefillWarmer()
        """Prefill warm-ups waiting to be posted (``remote_prefill="auto"``, ``fleet._warm``)."""
        self._warming: Background | None = None
        self._task_http: Callable[[], HTTPClient] = httpx.AsyncClient
        self._asynchronous = asynchronous
        self._closed = False
        self._lock = threading.Lock()

    def serves(self, options: FleetOptions) -> bool:
        """Whether ``options`` route exactly as this fleet does."""
        return all(
            a is b or a == b for a, b in zip(self._key, (getattr(options, n) for n in _FLEET_FIELDS), strict=True)
        )

    @property
    def pools(self) -> tuple[EndpointPool, EndpointPool]:
        return self.prefill, self.decode

    def start(self) -> None:
        """Start the background work if there is any (called on every call; cheap once running)."""
        if self.background is not None:
            self.background.start()

    def warm(self, endpoint: Endpoint, post: Fetch) -> None:
        """Queue a prefill warm-up for ``endpoint``, posted off the caller's path as soon as no
        caller's prefill is in flight there (``fleet._warm``)."""
        with self._lock:
            if self._closed:
                return
            warming = self._warm_ups()
        self.warmer.add(post, endpoint)
        warming.start()
        warming.wake()

    def start_warm_ups(self) -> None:
        """Start the warm-ups' driver now, not with the first warm-up: its first start builds
        an HTTP client (httpcore's import, a TLS context: ~0.15 s of CPU), which a server
        pays at its own start, not on the loop its first decode-only call's streams share."""
        with self._lock:
            if self._closed:
                return
            warming = self._warm_ups()
        warming.start()

    def send_background_with(self, transport: httpx.AsyncBaseTransport) -> None:
        """Have the background tasks (an async client's, on its loop) send with ``transport``,
        the legs' own (``pdclient serve``'s aiohttp: a third of httpx's CPU a request), not
        with a client and a connection pool of their own. Before the first call: a driver
        already started keeps its client."""
        with self._lock:
            self._task_http = functools.partial(TransportClient, transport)
            for background in (self.background, self._warming):
                if background is not None:
                    background.task_http = self._task_http

    def _warm_ups(self) -> Background:
        """The warm-ups' driver, made on first use (with ``_lock`` held)."""
        if self._warming is None:
            self._warming = Background(
                [self.warmer], asynchronous=self._asynchronous, name="pdclient-warm-up", max_sleep=WARM_UP_MAX_SLEEP
            )
            self._warming.task_http = self._task_http
            self.warmer.wake = self._warming.wake
            weakref.finalize(self, self._warming.close, wait=False).atexit = False
        return self._warming

    def _stopped(self) -> list[Background]:
        with self._lock:
            self._closed = True
        if self.kv_events is not None:
            self.kv_events.close()
        return [b for b in (self.background, self._warming) if b is not None]

    def close(self) -> None:
        """Stop the background work (a warm-up in flight is abandoned)."""
        for background in self._stopped():
            background.close()

    async def aclose(self) -> None:
        for background in self._stopped():
            await background.aclose()


def _policy(options: FleetOptions, leg: str) -> RoutingPolicy:
    return make_policy(options.policy_for(leg), load_signals=options.load_settings_for(leg) is not None)


def _background(
    options: FleetOptions, pools: tuple[EndpointPool, ...], asynchronous: bool, feeds: KVEventFeeds | None
) -> Background | None:
    """The cores the options turn on, in one ``Background``; None when every feature is off."""
    discovery = options.discovery if isinstance(options.discovery, DiscoverySettings) else None
    health = options.health_checks if isinstance(options.health_checks, HealthSettings) else None
    cores: list[Core] = []
    for pool in pools:
        named = any(not is_address(httpx.URL(url).host) for url in pool.urls)
        if discovery is not None and named:  # first: the members it adds are probed and scraped at once
            cores.append(DnsDiscovery(pool, discovery))
        if health is not None:
            cores.append(HealthProber(lambda pool=pool: pool.endpoints, health, leg=pool.leg))  # type: ignore[misc]
        scrape = options.load_settings_for(pool.leg)
        if scrape is not None:
            cores.append(LoadScraper(lambda pool=pool: pool.endpoints, scrape, leg=pool.leg))  # type: ignore[misc]
        if feeds is not None and isinstance(options.kv_events, str):
            cores.append(KVEventWatch(lambda pool=pool: pool.endpoints, options.kv_events, feeds))  # type: ignore[misc]
    if not cores:
        return None
    resolver = (discovery.resolver if discovery is not None else None) or system_resolver
    return Background(cores, asynchronous=asynchronous, resolver=resolver)
