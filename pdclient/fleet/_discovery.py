"""DNS discovery: a base URL whose name resolves to several addresses is a pool of them.

A Kubernetes headless Service (``clusterIP: None``) answers its name with one A/AAAA
record per ready pod. With discovery on, ``http://vllm-prefill.ns.svc:8000/v1`` becomes
one pool member per address (``http://10.1.2.3:8000/v1``, ...; scheme, port and path
kept), re-resolved every ``interval`` seconds:

- a new address joins the pool (``EndpointPool.set_members``) and is routed to at once;
- a vanished address leaves the pool, not the calls that hold it: they finish on it;
- a failed or empty lookup changes nothing (the last good set stays; its breakers and
  health probes deal with members that are gone), and is logged once until it recovers;
- until the first lookup answers, the name itself is the member (httpx resolves it).

Members made from a name keep it (``Endpoint.host_name``): requests to them must carry
``Host: name[:port]`` and, over https, the name as TLS SNI, so virtual hosting and
certificate checks see the name and not the address (``request_overrides``).

Interval: the Corefile Kubernetes installs serves cluster records with ``ttl 30`` behind
``cache 30`` (CoreDNS's own kubernetes-plugin default is 5 s; kubernetes/kubernetes#76238
set 30 s to match kube-dns), so a pod change can take ~30 s to show in DNS at all.
Re-resolving every 10 s adds at most 10 s to that for one query per pool per process.
A lookup runs in the background driver, in a worker thread (``getaddrinfo`` has no
timeout of its own: a hung resolver delays this name's next lookup by the resolver's own
timeout, and no other job).
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any

import httpx

from .._durations import check_seconds
from .._errors import PDConfigError
from ..pools import Endpoint, EndpointPool
from ._background import Job, JobResult, LookedUp, Lookup, Resolver, host_header

logger = logging.getLogger("pdclient")

Member = tuple[str, str | None]
"""(url, host_name): a pool member's URL and, when it holds an address of a name, the name."""


@dataclass(frozen=True)
class DiscoverySettings:
    """How named base URLs are re-resolved into pool members (defaults: see the module docstring)."""

    interval: float = 10.0
    """Seconds between two lookups of a name."""
    resolver: Resolver | None = None
    """``resolver(host, port) -> [address, ...]`` instead of the system's ``getaddrinfo``
    (tests pass several 127.0.0.x; a deployment may ask its own service registry)."""

    def __post_init__(self) -> None:
        check_seconds("DiscoverySettings.interval", self.interval)
        if self.resolver is not None and not callable(self.resolver):
            raise PDConfigError(f"DiscoverySettings.resolver must be callable, got {type(self.resolver).__name__}")


def is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def members_of(base_url: str, addresses: tuple[str, ...] | None) -> list[Member]:
    """The members a base URL stands for, given its name's addresses (None: not resolved yet)."""
    url = httpx.URL(base_url)
    if not addresses or is_address(url.host):
        return [(base_url, None)]
    return [(str(url.copy_with(host=address)), url.host) for address in addresses]


def request_overrides(endpoint: Endpoint) -> tuple[dict[str, str], dict[str, Any]]:
    """The headers and httpx extensions a request to ``endpoint`` needs: its DNS name as Host and SNI."""
    if endpoint.host_name is None:
        return {}, {}
    url = httpx.URL(endpoint.url)
    extensions: dict[str, Any] = {"sni_hostname": endpoint.host_name} if url.scheme == "https" else {}
    return {"host": host_header(url, endpoint.host_name)}, extensions


class DnsDiscovery:
    """Sans-I/O core: looks up the pool's named base URLs and makes their addresses its members."""

    def __init__(
        self,
        pool: EndpointPool,
        settings: DiscoverySettings | None = None,
    ) -> None:
        self.settings = settings or DiscoverySettings()
        self._pool = pool
        self._names = {base: httpx.URL(base) for base in pool.urls if not is_address(httpx.URL(base).host)}
        self._addresses: dict[str, tuple[str, ...] | None] = dict.fromkeys(pool.urls)
        self._failing: set[str] = set()
        self._next = 0.0
        self._out: set[str] = set()

    def __repr__(self) -> str:
        return f"DnsDiscovery({self._pool.leg}, {sorted(self._names)})"

    def members(self) -> list[Member]:
        """What the pool's members should be now, in the configured order."""
        found: dict[str, str | None] = {}
        for base in self._pool.urls:
            for url, name in members_of(base, self._addresses[base]):
                found.setdefault(url, name)
        return list(found.items())

    def due(self, now: float) -> list[Job]:
        if now < self._next or self._out:
            return []
        self._next = now + self.settings.interval
        jobs = []
        for base, url in self._names.items():
            port = url.port or (443 if url.scheme == "https" else 80)
            jobs.append(Job(base, Lookup(url.host, port)))
            self._out.add(base)
        return jobs

    def next_due(self) -> float:
        return float("inf") if self._out or not self._names else self._next

    def apply(self, job: Job, outcome: JobResult, now: float) -> None:
        base = job.key
        assert isinstance(base, str)
        self._out.discard(base)
        addresses = outcome.addresses if isinstance(outcome, LookedUp) else ()
        if not addresses:
            if base not in self._failing:
                self._failing.add(base)
                why = getattr(outcome, "error", None) or "no addresses"
                logger.warning(
                    "pdclient: DNS lookup for %s %s failed (%s); keeping its members", self._pool.leg, base, why
                )
            return
        if base in self._failing:
            self._failing.discard(base)
            logger.info("pdclient: DNS lookup for %s %s answers again", self._pool.leg, base)
        self._addresses[base] = tuple(addresses)
        wanted = self.members()
        if [e.url for e in self._pool.endpoints] == [url for url, _ in wanted]:
            return
        added, removed = self._pool.set_members(wanted)
        if added or removed:
            logger.info(
                "pdclient: %s pool members from DNS: +%s -%s",
                self._pool.leg,
                [e.url for e in added],
                [e.url for e in removed],
            )
