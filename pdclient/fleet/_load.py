"""Load signals: each server's own queue, read from its Prometheus ``/metrics``.

A client's in-flight count (``LeastOutstanding``) sees only its own calls. With several
client processes on one pool it is blind to the others: a server the others are
queueing on looks idle. vLLM publishes what it is doing (vLLM 0.32,
``vllm/v1/metrics/loggers.py``, labels ``model_name`` and ``engine``):

- ``vllm:num_requests_waiting``: requests queued for a slot in the batch;
- ``vllm:num_requests_running``: requests in the batch;
- ``vllm:kv_cache_usage_perc``: the fraction of KV-cache blocks in use, 0..1
  (``vllm:gpu_cache_usage_perc`` before vLLM 0.9.2, hidden from 0.11, gone in 0.12).

``LoadScraper`` (a sans-I/O core run by ``fleet._background``) reads them for every member of
a pool and leaves a ``LoadSample`` on the endpoint; ``LoadAware`` routes by them.

The defaults, against llm-d's endpoint picker (gateway-api-inference-extension
``pkg/epp/server/runserver.go``: ``DefaultRefreshMetricsInterval = 50 ms``,
``DefaultMetricsStalenessThreshold = 2 s``; its saturation detector's
``DefaultKVCacheUtilThreshold = 0.8``): the picker is one process per pool, so a server
pays for one scrape per 50 ms. pdclient scrapes from every client process, and a scrape
is not free: vLLM 0.32's answer is ~51 KB (614 lines) rendered in the API server's
process, ~7 ms a fetch on this machine's CPU build. N clients at 50 ms would cost a
server N x 14 % of a core; at 0.5 s, N x 1.4 %. The scraping process pays too: ~1.5 ms of
CPU a scrape here (httpx's GET of the 64 kB ~0.7-1.3 ms, the parse of the 3 lines it reads
~0.07 ms), and ~12 ms a second for a pair with health probes, event loop included (measured
with benchmarks/bench_idle_cpu.py against ~2 ms a second without). So pdclient scrapes every 0.5 s and
bridges the gap with what it knows exactly, the calls it started and ended since the
scrape (``LoadAware``, which also extrapolates them to the other clients). A sample is
fresh for 2 s as in llm-d (four missed scrapes), and a scrape gives up after 1 s. The
gauges are only as fresh as the server makes them: vLLM updates them when an engine
step's output reaches the API server (on a loaded CPU server here, every few seconds).
"""

from __future__ import annotations

import logging
import math
import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from .._durations import check_seconds
from .._errors import PDConfigError
from ..pools import Endpoint
from ..routing import LoadSample
from ._background import EveryMember, Fetch, Fetched, Job, JobResult

logger = logging.getLogger("pdclient")

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_BEFORE_0_9_2 = "vllm:gpu_cache_usage_perc"
_NAMES = frozenset((WAITING, RUNNING, KV_USAGE, KV_USAGE_BEFORE_0_9_2))

# One sample line of the Prometheus text format: name, optional {labels}, value, optional
# timestamp. Label values may hold any character, escaped quotes and braces included.
_SAMPLE = re.compile(
    r'(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>(?:[^"}]|"(?:[^"\\]|\\.)*")*)\})?'
    r"[ \t]+(?P<value>[^ \t]+)(?:[ \t]+-?[0-9]+)?[ \t]*"
)
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\]|\\.)*)"')
_UNESCAPE = re.compile(r"\\(.)")


@dataclass(frozen=True)
class ServerLoad:
    """The load figures of one ``/metrics`` answer."""

    waiting: float
    running: float
    kv_usage: float | None
    """None when the server does not publish it."""


def _label_value(raw: str) -> str:
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), raw)


def _family_lines(text: str) -> Iterator[str]:
    """The sample lines of ``text`` whose metric is one of ``_NAMES``.

    A vLLM 0.32 answer has ~450 sample lines (64 kB) and 3 of them matter: a search for each
    name (``str.find``, in C) visits only those, where a loop over every line cost ~1.1 ms
    a scrape on this machine's CPU, twice a second per server.
    """
    text = "\n" + text
    for name in _NAMES:
        needle = "\n" + name
        at = text.find(needle)
        while at >= 0:
            end = text.find("\n", at + 1)
            line = text[at + 1 : len(text) if end < 0 else end]
            if line[len(name) : len(name) + 1] in ("{", " ", "\t"):  # not a longer name
                yield line
            at = -1 if end < 0 else text.find(needle, end)


def parse_metrics(text: str, model: str | None = None) -> ServerLoad | None:
    """The load in a Prometheus text answer, or None when it lacks the request counts.

    Counts are summed over label sets (one per engine of a data-parallel server); the KV
    usage is their mean (each engine has its own cache, a request uses one of them).
    With ``model``, only label sets whose ``model_name`` is that model count. Lines that
    do not parse, non-finite or negative values, and a KV usage outside 0..1 are skipped.
    """
    sums: dict[str, list[float]] = {}
    for line in _family_lines(text):
        match = _SAMPLE.fullmatch(line.strip())
        if match is None or match["name"] not in _NAMES:
            continue
        if model is not None and match["labels"]:
            labels = {k: _label_value(v) for k, v in _LABEL.findall(match["labels"])}
            if labels.get("model_name", model) != model:
                continue
        try:
            value = float(match["value"])
        except ValueError:
            continue
        if not math.isfinite(value) or value < 0:
            continue
        if match["name"] in (KV_USAGE, KV_USAGE_BEFORE_0_9_2) and value > 1:
            continue
        sums.setdefault(match["name"], []).append(value)
    if WAITING not in sums or RUNNING not in sums:
        return None
    kv = sums.get(KV_USAGE) or sums.get(KV_USAGE_BEFORE_0_9_2)
    return ServerLoad(
        waiting=math.fsum(sums[WAITING]),
        running=math.fsum(sums[RUNNING]),
        kv_usage=math.fsum(kv) / len(kv) if kv else None,
    )


def server_url(base_url: str, path: str) -> str:
    """``path`` at the server root of an OpenAI base URL: vLLM serves /metrics and /health beside /v1."""
    root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
    return root + path


@dataclass(frozen=True)
class ScrapeSettings:
    """How a pool's scraper reads its servers' /metrics (defaults: see the module docstring)."""

    interval: float = 0.5
    """Seconds between two scrapes of one server."""
    staleness: float = 2.0
    """Seconds a sample counts; after that, as if there were none."""
    timeout: float = 1.0
    """Seconds one scrape may take, its whole answer included; longer is a failed scrape."""
    model: str | None = None
    """Count only this model's label sets (None: the server's whole load)."""
    path: str = "/metrics"
    """Where the server publishes its metrics, from its root (beside /v1, not under it)."""

    def __post_init__(self) -> None:
        for name in ("interval", "staleness", "timeout"):
            check_seconds(f"ScrapeSettings.{name}", getattr(self, name))
        if not self.staleness > self.interval:
            raise PDConfigError(f"ScrapeSettings.staleness must be > interval ({self.interval}), got {self.staleness}")
        if self.model is not None and not isinstance(self.model, str):
            raise PDConfigError(f"ScrapeSettings.model must be a model name or None, got {self.model!r}")
        if not (isinstance(self.path, str) and self.path.startswith("/")):
            raise PDConfigError(f"ScrapeSettings.path must start with '/', got {self.path!r}")


class EndpointPoller:
    """What the cores that GET one path of every pool member each ``interval`` share: the
    schedule (``EveryMember``), the jobs it makes due, and the member a job was for."""

    def __init__(
        self, members: Callable[[], Sequence[Endpoint]], *, interval: float, path: str, timeout: float, leg: str
    ) -> None:
        self._schedule = EveryMember(members, interval)
        self._path = path
        self._timeout = timeout
        self._leg = leg

    def due(self, now: float) -> list[Job]:
        return [
            Job(e, Fetch(server_url(e.url, self._path), self._timeout, host=e.host_name))
            for e in self._schedule.due(now)
        ]

    def next_due(self) -> float:
        return self._schedule.next_due()

    def _answered(self, job: Job) -> Endpoint:
        """The member ``job`` was for, due again from now on."""
        endpoint = job.key
        assert isinstance(endpoint, Endpoint)
        self._schedule.done(endpoint)
        return endpoint


class LoadScraper(EndpointPoller):
    """Sans-I/O core: scrapes every member of a pool every ``interval`` and leaves ``Endpoint.load``.

    ``members`` is called each time, so endpoints that discovery adds are scraped at once
    and removed ones are forgotten. A failed scrape leaves the last sample to go stale.
    """

    def __init__(
        self, members: Callable[[], Sequence[Endpoint]], settings: ScrapeSettings | None = None, *, leg: str = "pool"
    ) -> None:
        self.settings = settings = settings or ScrapeSettings()
        super().__init__(members, interval=settings.interval, path=settings.path, timeout=settings.timeout, leg=leg)
        self._failing: weakref.WeakSet[Endpoint] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"LoadScraper({self._leg}, {self.settings})"

    def apply(self, job: Job, outcome: JobResult, now: float) -> None:
        endpoint = self._answered(job)
        load = None
        if isinstance(outcome, Fetched) and outcome.ok:
            load = parse_metrics(outcome.text, self.settings.model)
            problem = "its answer has no vLLM request counts"
        else:
            problem = getattr(outcome, "error", None) or f"HTTP {getattr(outcome, 'status', '?')}"
        if load is None:
            if endpoint not in self._failing:
                self._failing.add(endpoint)
                logger.warning(
                    "pdclient: no load signal from %s %s (%s); load-aware routing uses this process's "
                    "in-flight counts while a sample is stale",
                    self._leg,
                    server_url(endpoint.url, self.settings.path),
                    problem,
                )
            return
        if endpoint in self._failing:
            self._failing.discard(endpoint)
            logger.info("pdclient: load signal from %s %s is back", self._leg, endpoint.url)
        endpoint.load = LoadSample(
            waiting=load.waiting,
            running=load.running,
            kv_usage=load.kv_usage,
            taken_at=now,
            fresh_until=now + self.settings.staleness,
            local_in_flight=endpoint.in_flight,
        )
