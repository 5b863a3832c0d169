"""The load-aware policy: the least loaded endpoint by the servers' own counts (``Endpoint.load``)."""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from .._errors import PDConfigError
from ._endpoint import EndpointView, LoadSample, Routed
from ._policy import RouteDecision

if TYPE_CHECKING:
    from ._policy import RouteRequest


MAX_EXTRAPOLATION = 64.0


@dataclass(eq=False, kw_only=True)
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
    peak-sensitive moving average of its answer times, ``pools._latency``; 1 when it has no
    estimate or is not slower): the counts are the same for a server that works through
    them 4x more slowly, or whose slots another tenant's long requests hold; its latency
    is not. A penalty, never a bonus, so an endpoint whose estimate decayed while it was
    avoided competes again by its counts alone. This is the cost of Finagle's and tower's
    ``PeakEwma`` balancers, latency x (outstanding + 1), relative to the pool (measured,
    bench_fleet.py (a): p99 0.85x least-outstanding's on a slow server that the counts
    alone cannot tell, 1.00x; see docs/fleet.md).

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

    waiting_weight: float = 1.0
    running_weight: float = 1.0
    kv_threshold: float = 0.8
    extrapolate: bool = True
    latency: bool = True
    clock: Callable[[], float] = field(default=time.monotonic, repr=False)
    rng: random.Random = field(default_factory=random.Random, repr=False)
    """Breaks ties between equally loaded endpoints."""

    def __post_init__(self) -> None:
        if self.waiting_weight < 0 or self.running_weight < 0 or not 0 < self.kv_threshold <= 1:
            raise PDConfigError("LoadAware: weights must be >= 0 and kv_threshold in (0, 1]")

    def scores(self, endpoints: Sequence[Routed]) -> list[float] | None:
        """Each endpoint's score, or None when any of them has no fresh sample."""
        now = self.clock()
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
    def slowness(endpoints: Sequence[Routed]) -> list[float]:
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

    def loads(self, endpoints: Sequence[Routed]) -> list[float]:
        """The scores, or this process's in-flight counts when they are not all fresh."""
        scores = self.scores(endpoints)
        return scores if scores is not None else [float(e.in_flight) for e in endpoints]

    def choose(self, endpoints: Sequence[Routed], request: RouteRequest) -> Routed:
        return self.decide(endpoints, request).endpoint

    def decide(self, endpoints: Sequence[Routed], request: RouteRequest) -> RouteDecision[Routed]:
        scores = self.scores(endpoints)
        if scores is None:
            return RouteDecision(self.name, min(endpoints, key=lambda e: e.in_flight), "stale")
        roomy: Sequence[int] = [i for i, e in enumerate(endpoints) if not self._full(e)] or range(len(endpoints))
        # Ties: the one with fewer of this process's calls (least-outstanding's rule, which
        # also differs between processes), then a random one.
        best = min((scores[i], endpoints[i].in_flight) for i in roomy)
        tied = [i for i in roomy if (scores[i], endpoints[i].in_flight) == best]
        chosen = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        detail = {"score": round(scores[chosen], 2)}
        if len(roomy) < len(endpoints):
            detail["full"] = len(endpoints) - len(roomy)
        return RouteDecision(self.name, endpoints[chosen], "load", detail)

    def _full(self, endpoint: EndpointView) -> bool:
        sample = endpoint.load
        return sample is not None and sample.kv_usage is not None and sample.kv_usage > self.kv_threshold
