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
``DefaultKVCacheUtilThreshold = 0.8``): the picker is one process per pool that sees all
traffic, so it can afford to scrape every 50 ms. pdclient scrapes from every client
process, so N clients cost a server N scrapes per interval (each renders the whole
registry in the API server's process); it scrapes every 0.5 s and bridges the gap with
what it knows exactly, its own calls started and finished since the scrape. A sample is
fresh for 2 s as in llm-d (four missed scrapes), and a scrape gives up after 1 s.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

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
