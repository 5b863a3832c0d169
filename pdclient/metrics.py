"""Prometheus metrics for P/D calls: one observer, ``PrometheusObserver`` (``pdclient[prometheus]``).

``pdclient serve`` exports these on ``/metrics``; an SDK user passes the same observer to
their own clients and exports from their own process::

    from prometheus_client import CollectorRegistry, start_http_server
    from pdclient.metrics import PrometheusObserver

    registry = CollectorRegistry()                 # or leave it out: prometheus_client's global REGISTRY
    metrics = PrometheusObserver(registry)
    client = AsyncPDChatClient(..., observers=[metrics])
    metrics.watch(client)                          # breaker state and in-flight count per endpoint
    start_http_server(9100, registry=registry)

Metrics (``namespace`` prefix, ``pdclient`` by default; times in seconds):

=====================================  =========  ===============================================
``pdclient_calls_total``               counter    finished calls by ``route`` and ``outcome`` (``PDTrace.outcome``:
                                                  ``decode_only`` is decode-only by decision,
                                                  ``prefill_failed`` a prefill failure's fallback)
``pdclient_remote_prefill_decisions_total`` counter  chat/completions calls by ``route``, ``remote_prefill``
                                                  (true, false) and ``reason`` (``PDTrace.remote_prefill_reason``:
                                                  ``auto``'s are decode_only_faster, handoff_faster,
                                                  stall_over_budget, and the rules before the costs)
``pdclient_dispatch_total``            counter    calls with a prefill leg by ``route``, ``dispatch`` (sequential,
                                                  concurrent: how the legs went out, ``PDOptions.dispatch``) and
                                                  ``fallback`` (``PDTrace.dispatch_fallback``, empty when none):
                                                  ``fallback="prompt_drift"`` counts decodes that rendered another
                                                  prompt than their prefill (the servers' templates differ),
                                                  ``prompt_unchecked`` those that gave no prompt ids to compare
``pdclient_dispatch_decisions_total``  counter    ``dispatch="auto"``'s choices on the cost model, by ``route``,
                                                  ``dispatch`` and ``reason`` (``PDTrace.decision.dispatch_reason``:
                                                  learning, concurrent_faster, sequential_faster, probe,
                                                  coordinates_unstable)
``pdclient_calls_in_flight``           gauge      calls started and not yet finished, by ``route``
``pdclient_call_duration_seconds``     histogram  call start to end (the whole stream), by ``route``
``pdclient_time_to_first_token_seconds`` histogram  call start to the decode's first body byte
``pdclient_leg_duration_seconds``      histogram  one leg attempt, sent to body read or closed, by
                                                  ``leg`` (prefill, decode, release), ``endpoint``
                                                  and ``status`` (HTTP status, or ``error``)
``pdclient_forwarded_tokens_total``    counter    prompt token ids forwarded to decode, by ``route``
``pdclient_routing_decisions_total``   counter    leg attempts by ``leg``, ``policy`` and ``rule``
                                                  (``leg.decision``; ``rule`` is empty for one-rule
                                                  policies): e.g. cache-aware hits are ``rule="cache"``
``pdclient_routed_prompt_chars_total``  counter    cache-aware routing: prompt characters routed, by ``leg``
``pdclient_routed_match_chars_total``   counter    of those, the characters the chosen server was sent
                                                  before (match / prompt: the predicted prefix-cache hit rate)
``pdclient_decode_migrations_total``   counter    decode streams moved to another endpoint after
                                                  they broke, by ``route`` and ``via`` (decode,
                                                  prefill+decode): ``max_decode_migrations``
``pdclient_decode_migration_pause_seconds`` histogram  the caller's pause at each move (last chunk
                                                  before the cut to the first after it)
``pdclient_endpoint_state``            gauge      1 for each endpoint's current breaker ``state``
                                                  (closed, open, half-open), 0 for the others
``pdclient_endpoint_in_flight``        gauge      requests in flight per endpoint
``pdclient_cost_fixed_ms``             gauge      ``auto``'s cost model: a line's fixed step, by ``line``
                                                  (decode_prefill, handoff, answer: a decode endpoint's
                                                  streams' answer time, which the stall budget is a
                                                  share of) and ``endpoint`` (a decode's; empty for
                                                  the handoff line, learnt over every handoff)
``pdclient_cost_ms_per_token``         gauge      the same line's milliseconds per uncached token
``pdclient_cost_samples``              gauge      the live calls it was fitted to (0: the prior)
``pdclient_build_info``                gauge      1, with the ``version`` of pdclient and the ``python`` it runs on
=====================================  =========  ===============================================

The endpoint and cost gauges are read when scraped, from the clients or transports given to ``watch``.
An ``endpoint`` label is the endpoint's base URL with its credentials, if it has any
(``http://user:password@host``), shown as ``***@``.
The observer is thread-safe (prometheus_client's metrics are) and keeps its per-call
state in ``call.data``. Under prometheus_client's multiprocess mode the call metrics are
aggregated across processes (the in-flight gauge as ``livesum``); endpoint metrics stay
per process, since every process has breakers of its own.
"""

from __future__ import annotations

import copy
import functools
import platform
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from ._errors import PDConfigError
from ._observe import CallView, LegView, PDObserver
from .costs import Line
from .fleet import Fleet
from .wire import redact_url

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.metrics_core import Metric

    from ._trace import PDTrace

try:
    import prometheus_client
    from prometheus_client.core import GaugeMetricFamily
    from prometheus_client.registry import Collector
except ImportError:  # pragma: no cover - the extra is not installed
    prometheus_client = None  # type: ignore[assignment]
    Collector = object  # type: ignore[assignment,misc]

LATENCY_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
"""Seconds: from a loopback prefill (ms) to a long generation (minutes)."""

BREAKER_STATES = ("closed", "open", "half-open")


class EndpointState(NamedTuple):
    """One endpoint of a fleet as a scrape (or ``pdclient serve``'s ``/ready``) shows it."""

    leg: str
    """``prefill`` or ``decode``."""
    url: str
    """Its base URL, credentials (``user:password@``) shown as ``***@``."""
    state: str
    """The circuit breaker's: ``closed``, ``open`` or ``half-open``."""
    admitted: bool
    """Whether the breaker lets a request through now."""
    in_flight: int


def _fleet_of(source: object) -> Fleet:
    """The ``Fleet`` of a pdclient client (``pd_fleet``), a transport (``fleet``) or the fleet itself."""
    fleet = source if isinstance(source, Fleet) else getattr(source, "pd_fleet", getattr(source, "fleet", None))
    if not isinstance(fleet, Fleet):
        raise PDConfigError(f"expected a pdclient client, transport or Fleet, got {type(source).__name__}")
    return fleet


def endpoint_states(source: object) -> list[EndpointState]:
    """The endpoints of a pdclient client (``pd_fleet``), a transport (``fleet``) or a ``Fleet``."""
    fleet = _fleet_of(source)
    return [
        EndpointState(pool.leg, redact_url(e.url), e.state, e.admits(), e.in_flight)
        for pool in fleet.pools
        for e in pool.endpoints
    ]


EndpointSource = Callable[[], Iterable[EndpointState]]


class PrometheusObserver(PDObserver):
    """Counts, times and gauges P/D calls into a prometheus_client registry.

    ``registry``: where the metrics are registered (default: prometheus_client's global
    ``REGISTRY``). One observer per registry and namespace: a second one would register the
    same names twice, which prometheus_client refuses.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        *,
        namespace: str = "pdclient",
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        if prometheus_client is None:
            raise ImportError("prometheus_client is not installed: pip install 'pdclient[prometheus]'")
        self.registry = prometheus_client.REGISTRY if registry is None else registry
        self.namespace = namespace
        p, r = prometheus_client, self.registry
        counter = functools.partial(p.Counter, namespace=namespace, registry=r)
        gauge = functools.partial(p.Gauge, namespace=namespace, registry=r)
        histogram = functools.partial(p.Histogram, namespace=namespace, registry=r, buckets=buckets)
        self.calls = counter("calls", "Finished P/D calls.", ["route", "outcome"])
        self.remote_prefill_decisions = counter(
            "remote_prefill_decisions",
            "Whether a call got a remote prefill (remote_prefill), and why.",
            ["route", "remote_prefill", "reason"],
        )
        self.dispatch = counter(
            "dispatch",
            "How a call's two legs went out (dispatch), and why a concurrent decode went out again (fallback).",
            ["route", "dispatch", "fallback"],
        )
        self.dispatch_decisions = counter(
            "dispatch_decisions",
            "dispatch=auto's choice of sequential or concurrent on the cost model, and why.",
            ["route", "dispatch", "reason"],
        )
        self.in_flight = gauge(
            "calls_in_flight", "P/D calls started and not yet finished.", ["route"], multiprocess_mode="livesum"
        )
        self.call_duration = histogram(
            "call_duration_seconds", "From a call's start to its end (a streamed answer's last byte).", ["route"]
        )
        self.ttft = histogram(
            "time_to_first_token_seconds", "From a call's start to the first byte of the decode's answer.", ["route"]
        )
        self.leg_duration = histogram(
            "leg_duration_seconds",
            "One leg attempt, from sending it until its body was read or closed.",
            ["leg", "endpoint", "status"],
        )
        self.forwarded_tokens = counter(
            "forwarded_tokens", "Prompt token ids forwarded from the prefill to the decode leg.", ["route"]
        )
        self.routing_decisions = counter(
            "routing_decisions",
            "Leg attempts by the routing policy that chose their endpoint and the rule that decided.",
            ["leg", "policy", "rule"],
        )
        self.routed_prompt_chars = counter(
            "routed_prompt_chars", "Cache-aware routing: prompt characters routed.", ["leg"]
        )
        self.routed_match_chars = counter(
            "routed_match_chars",
            "Cache-aware routing: prompt characters the chosen server was sent before (a predicted cache hit).",
            ["leg"],
        )
        self.migrations = counter(
            "decode_migrations", "Decode streams that broke and continued on another decode endpoint.", ["route", "via"]
        )
        self.migration_pause = histogram(
            "decode_migration_pause_seconds",
            "The caller's pause when its decode stream moved: last chunk before the cut to the first after it.",
            ["route"],
        )
        r.register(BuildInfo(namespace))
        self._endpoints = _EndpointCollector(namespace)
        self._endpoints_registered: set[int] = set()
        self._lock = threading.Lock()
        self._children: dict[tuple[Any, tuple[str, ...]], Any] = {}

    def __repr__(self) -> str:
        return f"PrometheusObserver(namespace={self.namespace!r})"

    # -- endpoints -------------------------------------------------------------------

    def watch(self, source: object, *, registry: CollectorRegistry | None = None) -> None:
        """Export breaker state and in-flight count of the endpoints of ``source`` (a pdclient
        client or transport, or a callable returning ``EndpointState``s), read when scraped.

        ``registry``: where to export them (default: the observer's own).
        """
        states: EndpointSource = source if callable(source) else lambda: endpoint_states(source)
        self._endpoints.sources.append(states)
        if not callable(source):
            self._endpoints.cost_sources.append(_fleet_of(source).costs.lines)
        target = self.registry if registry is None else registry
        with self._lock:
            if id(target) not in self._endpoints_registered:
                target.register(self._endpoints)
                self._endpoints_registered.add(id(target))

    def _labelled(self, metric: Any, *values: str) -> Any:
        """``metric.labels(*values)``, kept: prometheus_client checks and looks the labels up
        under a lock on every call (~3 us, a dozen times a call), and returns the same child
        for the same values, so the first answer serves every later one."""
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    # -- events ----------------------------------------------------------------------

    def on_call_start(self, call: CallView) -> None:
        self._labelled(self.in_flight, call.route).inc()

    def on_leg_start(self, call: CallView, leg: LegView) -> None:
        decision = getattr(leg, "decision", None)
        if decision is None:
            return
        self._labelled(self.routing_decisions, leg.name, decision.policy, decision.rule or "").inc()
        prompt = decision.detail.get("prompt")
        if prompt:
            self._labelled(self.routed_prompt_chars, leg.name).inc(prompt)
            self._labelled(self.routed_match_chars, leg.name).inc(decision.detail.get("match", 0))

    def on_leg_end(self, call: CallView, leg: LegView, status: int | None, error: BaseException | None) -> None:
        label = "error" if error is not None or status is None else str(status)
        duration = time.perf_counter() - leg.sent_at
        self._labelled(self.leg_duration, leg.name, redact_url(leg.url), label).observe(duration)

    def on_first_byte(self, call: CallView) -> None:
        self._labelled(self.ttft, call.route).observe(time.perf_counter() - call.started)

    def on_call_end(self, call: CallView, trace: PDTrace) -> None:
        route = call.route
        self._labelled(self.in_flight, route).dec()
        self._labelled(self.calls, route, trace.outcome.value).inc()
        if trace.remote_prefill is not None:
            remote = "true" if trace.remote_prefill else "false"
            self._labelled(self.remote_prefill_decisions, route, remote, trace.remote_prefill_reason or "").inc()
        if trace.dispatch is not None:
            self._labelled(self.dispatch, route, trace.dispatch, trace.dispatch_fallback or "").inc()
        chose = trace.decision.dispatch_reason if trace.decision is not None else None
        if chose is not None and trace.dispatch is not None:
            self._labelled(self.dispatch_decisions, route, trace.dispatch, chose).inc()
        self._labelled(self.call_duration, route).observe(time.perf_counter() - call.started)
        if trace.forwarded_tokens:
            self._labelled(self.forwarded_tokens, route).inc(trace.forwarded_tokens)
        for moved in trace.migrations:
            self._labelled(self.migrations, route, moved.route).inc()
            if moved.pause_ms is not None:
                self._labelled(self.migration_pause, route).observe(moved.pause_ms / 1000)


class BuildInfo(Collector):
    """``<namespace>_build_info``: 1, labelled with pdclient's version and Python's."""

    def __init__(self, namespace: str = "pdclient") -> None:
        from . import __version__

        self.namespace = namespace
        self.labels = {"version": __version__, "python": platform.python_version()}

    def collect(self) -> Iterator[Metric]:
        info = GaugeMetricFamily(
            f"{self.namespace}_build_info", "pdclient's version and Python's, as labels.", labels=list(self.labels)
        )
        info.add_metric(list(self.labels.values()), 1.0)
        yield info


class WithoutCreated:
    """A registry's metrics without their ``_created`` samples, for an exposition.

    prometheus_client adds a ``_created`` sample (the child's creation time) to every
    counter and histogram child, which the text format shows as a series of its own: one
    more per counter, nearly doubling a scrape of counters. ``disable_created_metrics()``
    drops them for the whole process, a choice that belongs to the process's owner, not
    to an observer; so the proxy exposes its registry through this view instead.
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self.registry.collect():
            created = metric.name + "_created"
            if any(sample.name == created for sample in metric.samples):
                metric = copy.copy(metric)
                metric.samples = [sample for sample in metric.samples if sample.name != created]
            yield metric


CostSource = Callable[[], Iterable[tuple[str, str, Line]]]


class _EndpointCollector(Collector):
    """Endpoint and cost-model gauges computed at scrape time from the watched sources."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.sources: list[EndpointSource] = []
        self.cost_sources: list[CostSource] = []

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily(
            f"{self.namespace}_endpoint_state",
            "Circuit breaker state per endpoint: 1 for the current state, 0 for the others.",
            labels=["leg", "endpoint", "state"],
        )
        in_flight = GaugeMetricFamily(
            f"{self.namespace}_endpoint_in_flight",
            "Requests in flight per endpoint.",
            labels=["leg", "endpoint"],
        )
        for source in list(self.sources):
            for endpoint in source():
                url = redact_url(endpoint.url)  # a source of one's own may not have
                for name in BREAKER_STATES:
                    state.add_metric([endpoint.leg, url, name], float(endpoint.state == name))
                in_flight.add_metric([endpoint.leg, url], float(endpoint.in_flight))
        yield state
        yield in_flight
        yield from self._costs()

    def _costs(self) -> Iterator[Metric]:
        """Why ``auto`` decides as it does, readable beside its decisions: the lines it predicts with."""
        labels = ["line", "endpoint"]
        fixed = GaugeMetricFamily(f"{self.namespace}_cost_fixed_ms", "A cost line's fixed step (ms).", labels=labels)
        per_token = GaugeMetricFamily(
            f"{self.namespace}_cost_ms_per_token", "A cost line's milliseconds per uncached token.", labels=labels
        )
        samples = GaugeMetricFamily(
            f"{self.namespace}_cost_samples", "The live calls a cost line was fitted to (0: its prior).", labels=labels
        )
        seen: set[tuple[str, str]] = set()
        for source in list(self.cost_sources):
            for name, endpoint, line in source():
                key = (name, redact_url(endpoint) if endpoint else "")
                if key in seen:
                    continue  # one fleet watched twice (a client and its transport)
                seen.add(key)
                fixed.add_metric(list(key), line.fixed_ms)
                per_token.add_metric(list(key), line.ms_per_token)
                samples.add_metric(list(key), float(line.samples))
        yield fixed
        yield per_token
        yield samples


__all__ = ["LATENCY_BUCKETS", "EndpointState", "PrometheusObserver", "endpoint_states"]
