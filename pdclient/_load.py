"""Load signals: each server's own queue, read from its Prometheus ``/metrics``.

A client's in-flight count (``LeastOutstanding``) sees only its own calls. With several
client processes on one pool it is blind to the others: a server the others are
queueing on looks idle. vLLM publishes what it is doing (vLLM 0.32,
``vllm/v1/metrics/loggers.py``, labels ``model_name`` and ``engine``):

- ``vllm:num_requests_waiting``: requests queued for a slot in the batch;
- ``vllm:num_requests_running``: requests in the batch;
- ``vllm:kv_cache_usage_perc``: the fraction of KV-cache blocks in use, 0..1
  (``vllm:gpu_cache_usage_perc`` before vLLM 0.9.2, hidden from 0.11, gone in 0.12).

``LoadScraper`` (a sans-I/O core run by ``_background``) reads them for every member of
a pool and leaves a ``LoadSample`` on the endpoint; ``LoadAware`` routes by them.

The defaults, against llm-d's endpoint picker (gateway-api-inference-extension
``pkg/epp/server/runserver.go``: ``DefaultRefreshMetricsInterval = 50 ms``,
``DefaultMetricsStalenessThreshold = 2 s``; its saturation detector's
``DefaultKVCacheUtilThreshold = 0.8``): the picker is one process per pool, so a server
pays for one scrape per 50 ms. pdclient scrapes from every client process, and a scrape
is not free: vLLM 0.32's answer is ~51 KB (614 lines) rendered in the API server's
process, ~7 ms a fetch on this machine's CPU build. N clients at 50 ms would cost a
server N x 14 % of a core; at 0.5 s, N x 1.4 %. So pdclient scrapes every 0.5 s and
bridges the gap with what it knows exactly, the calls it started and ended since the
scrape (``LoadAware``, which also extrapolates them to the other clients). A sample is
fresh for 2 s as in llm-d (four missed scrapes), and a scrape gives up after 1 s. The
gauges are only as fresh as the server makes them: vLLM updates them when an engine
step's output reaches the API server (on a loaded CPU server here, every few seconds).
"""

from __future__ import annotations

import logging
import math
import random
import re
import statistics
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ._background import EveryMember, Fetch, Fetched, Job, Outcome, check_number
from ._endpoints import Endpoint
from ._errors import PDConfigError
from ._routing import RouteDecision, RouteRequest

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


@dataclass(frozen=True)
class LoadSample:
    """One scrape of one server, as the scraper leaves it on ``Endpoint.load``."""

    waiting: float
    running: float
    kv_usage: float | None
    taken_at: float
    """Clock time (``time.monotonic``) the answer arrived."""
    fresh_until: float
    """After this the sample says nothing: routing falls back to this process's own view."""
    local_in_flight: int
    """This process's calls in flight on the endpoint when the answer arrived (the
    server's counts include them): the difference from the current count is what the
    server has got from us since."""

    def fresh(self, now: float) -> bool:
        return now < self.fresh_until


def _label_value(raw: str) -> str:
    return _UNESCAPE.sub(lambda m: "\n" if m.group(1) == "n" else m.group(1), raw)


def parse_metrics(text: str, model: str | None = None) -> ServerLoad | None:
    """The load in a Prometheus text answer, or None when it lacks the request counts.

    Counts are summed over label sets (one per engine of a data-parallel server); the KV
    usage is their mean (each engine has its own cache, a request uses one of them).
    With ``model``, only label sets whose ``model_name`` is that model count. Lines that
    do not parse, non-finite or negative values, and a KV usage outside 0..1 are skipped.
    """
    sums: dict[str, list[float]] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue  # comments, other metrics: most of a vLLM answer
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
            check_number("ScrapeSettings", name, getattr(self, name))
        if not self.staleness > self.interval:
            raise PDConfigError(f"ScrapeSettings.staleness must be > interval ({self.interval}), got {self.staleness}")
        if self.model is not None and not isinstance(self.model, str):
            raise PDConfigError(f"ScrapeSettings.model must be a model name or None, got {self.model!r}")
        if not (isinstance(self.path, str) and self.path.startswith("/")):
            raise PDConfigError(f"ScrapeSettings.path must start with '/', got {self.path!r}")


class LoadScraper:
    """Sans-I/O core: scrapes every member of a pool every ``interval`` and leaves ``Endpoint.load``.

    ``members`` is called each time, so endpoints that discovery adds are scraped at once
    and removed ones are forgotten. A failed scrape leaves the last sample to go stale.
    """

    def __init__(
        self, members: Callable[[], Sequence[Endpoint]], settings: ScrapeSettings | None = None, *, leg: str = "pool"
    ) -> None:
        self.settings = settings or ScrapeSettings()
        self._schedule = EveryMember(members, self.settings.interval)
        self._leg = leg
        self._failing: weakref.WeakSet[Endpoint] = weakref.WeakSet()

    def __repr__(self) -> str:
        return f"LoadScraper({self._leg}, {self.settings})"

    def due(self, now: float) -> list[Job]:
        return [
            Job(e, Fetch(server_url(e.url, self.settings.path), self.settings.timeout, host=e.host_name))
            for e in self._schedule.due(now)
        ]

    def next_due(self) -> float:
        return self._schedule.next_due()

    def apply(self, job: Job, outcome: Outcome, now: float) -> None:
        endpoint = job.key
        assert isinstance(endpoint, Endpoint)
        self._schedule.done(endpoint)
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


MAX_EXTRAPOLATION = 64.0


class LoadAware:
    """The least loaded endpoint by the servers' own counts, plus the calls made since.

    score = ``waiting_weight`` x waiting + ``running_weight`` x running (at the scrape)
    + scale x (this process's in-flight calls now - those at the scrape). Endpoints whose
    KV cache is fuller than ``kv_threshold`` are avoided unless all are.

    ``scale`` (``extrapolate``, on by default) is the servers' outstanding requests over
    this process's, at the scrape (1..64): every client process reads the same scrape and
    routes alike, so for each call this one placed since, the others placed about
    ``scale - 1`` more. Counting only its own (scale 1), every process piles onto the
    server the last scrape showed idlest until the next scrape (measured: bench_fleet.py
    (a), p99 0.75x least-outstanding's without, 0.49x with). Ends are scaled as starts
    are: scaling only the starts (the others' calls do not end where this one's do)
    inflated every busy server's score between scrapes, and sent ~9 % of the calls to
    the slowed one (p99 1.0-1.5x least-outstanding's, in one 3-round run).

    When any candidate has no fresh sample, the scores are not comparable and it routes
    as ``LeastOutstanding`` (this process's own view). Ties go to the endpoint with fewer of this process's calls
    (least-outstanding's rule, which differs between processes), then to a random one,
    so processes that read the same scrape do not all pick the same server.

    ``latency`` (on by default) multiplies each score + 1 by how much slower than the
    pool's median the endpoint has been answering this process (``Endpoint.latency``, a
    peak-sensitive moving average of its answer times, ``_latency``; 1 when it has no
    estimate or is not slower): the counts are the same for a server that works through
    them 4x more slowly, or whose slots another tenant's long requests hold; its latency
    is not. A penalty, never a bonus, so an endpoint whose estimate decayed while it was
    avoided competes again by its counts alone. This is the cost of Finagle's and tower's
    ``PeakEwma`` balancers, latency x (outstanding + 1), relative to the pool (measured,
    bench_fleet.py (a): p99 0.85x least-outstanding's on a slow server that the counts
    alone cannot tell, 1.00x; see the README).

    Defaults: a server's load is its outstanding requests, queued or running, as the
    SGLang / vllm-router ``cache_aware`` balancer counts a worker's load; the two weights
    let a deployment whose queueing hurts most weigh ``waiting`` up, as llm-d's queue
    scorer does (it scores waiting only). ``kv_threshold`` 0.8 is llm-d's
    ``DefaultKVCacheUtilThreshold``, the KV usage above which its saturation detector
    counts a server as full.
    """

    name = "load_aware"
    wants_prompt_text = False
    wants_load_signals = True

    def __init__(
        self,
        *,
        waiting_weight: float = 1.0,
        running_weight: float = 1.0,
        kv_threshold: float = 0.8,
        extrapolate: bool = True,
        latency: bool = True,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        if waiting_weight < 0 or running_weight < 0 or not 0 < kv_threshold <= 1:
            raise PDConfigError("LoadAware: weights must be >= 0 and kv_threshold in (0, 1]")
        self.waiting_weight = waiting_weight
        self.running_weight = running_weight
        self.kv_threshold = kv_threshold
        self.extrapolate = extrapolate
        self.latency = latency
        self._clock = clock
        self._rng = rng or random.Random()

    def scores(self, endpoints: Sequence[Endpoint]) -> list[float] | None:
        """Each endpoint's score, or None when any of them has no fresh sample."""
        now = self._clock()
        samples = []
        for endpoint in endpoints:
            sample = endpoint.load
            if sample is None or not sample.fresh(now):
                return None
            samples.append(sample)
        scale = self._scale(samples) if self.extrapolate else 1.0
        slowness = self.slowness(endpoints) if self.latency else [1.0] * len(endpoints)
        scores = []
        for endpoint, sample, slower in zip(endpoints, samples, slowness, strict=True):
            since = endpoint.in_flight - sample.local_in_flight
            server = self.waiting_weight * sample.waiting + self.running_weight * sample.running
            counts = max(0.0, server + scale * since)
            scores.append(counts if slower == 1.0 else (counts + 1) * slower - 1)
        return scores

    @staticmethod
    def slowness(endpoints: Sequence[Endpoint]) -> list[float]:
        """Each endpoint's latency estimate over the median of theirs, at least 1 (1 without an estimate)."""
        estimates = [e.latency.estimate() for e in endpoints]
        known = [x for x in estimates if x is not None and x > 0]
        if len(known) < 2:
            return [1.0] * len(endpoints)
        median = statistics.median(known)
        return [1.0 if x is None else max(1.0, x / median) for x in estimates]

    @staticmethod
    def _scale(samples: Sequence[LoadSample]) -> float:
        """How many calls the pool's clients made for each of ours: outstanding at the servers / ours, at the scrape."""
        ours = sum(s.local_in_flight for s in samples)
        theirs = sum(s.waiting + s.running for s in samples)
        return min(MAX_EXTRAPOLATION, max(1.0, theirs / max(1, ours)))

    def loads(self, endpoints: Sequence[Endpoint]) -> list[float]:
        """The scores, or this process's in-flight counts when they are not all fresh."""
        scores = self.scores(endpoints)
        return scores if scores is not None else [float(e.in_flight) for e in endpoints]

    def choose(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> Endpoint:
        return self.decide(endpoints, request).endpoint

    def decide(self, endpoints: Sequence[Endpoint], request: RouteRequest) -> RouteDecision:
        scores = self.scores(endpoints)
        if scores is None:
            return RouteDecision(self.name, min(endpoints, key=lambda e: e.in_flight), "stale")
        roomy: Sequence[int] = [i for i, e in enumerate(endpoints) if not self._full(e)] or range(len(endpoints))
        # Ties: the one with fewer of this process's calls (least-outstanding's rule, which
        # also differs between processes), then a random one.
        best = min((scores[i], endpoints[i].in_flight) for i in roomy)
        tied = [i for i in roomy if (scores[i], endpoints[i].in_flight) == best]
        chosen = tied[0] if len(tied) == 1 else self._rng.choice(tied)
        detail = {"score": round(scores[chosen], 2)}
        if len(roomy) < len(endpoints):
            detail["full"] = len(endpoints) - len(roomy)
        return RouteDecision(self.name, endpoints[chosen], "load", detail)

    def _full(self, endpoint: Endpoint) -> bool:
        sample = endpoint.load
        return sample is not None and sample.kv_usage is not None and sample.kv_usage > self.kv_threshold
