"""OpenTelemetry spans for P/D calls, as an observer (the ``pdclient[otel]`` extra).

Every chat or completions call records::

    pdclient.chat                 one span per call, PDTrace fields as pdclient.* attributes
    ├── pdclient.prefill          one span per prefill attempt (retries show as siblings)
    └── pdclient.decode           from sending the decode request until its body is closed

A decode stream that broke and moved to another endpoint (``max_decode_migrations``) shows
as a second ``pdclient.decode`` span (its ``pdclient.attempt`` one higher, after a prefill
span when the continuation took a prefill); the call span counts the moves in
``pdclient.migrations`` and has one ``pdclient.migration`` event per move (from, to, after
how many tokens, the pause in ms, the route and the cause).

The call span nests under whatever span is current when the call is made, e.g. the
``chat <model>`` span of ``opentelemetry-instrumentation-openai-v2``, which still sees one
call: the split into legs happens below the openai SDK. Pass-through requests (models,
embeddings, ...) get no spans; httpx instrumentation covers those.

    client = PDChatClient(..., observers=[OTelObserver(tracer_provider=provider)])
    client = instrument(client, tracer_provider=provider)      # the same, on an existing client

Nothing imports OpenTelemetry until an ``OTelObserver`` is made.
"""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

import httpx

from ._client import _PDClient
from ._errors import PDConfigError
from ._observe import CallView, LegView, PDObserver
from ._trace import Outcome, PDTrace
from .transport import AsyncPDTransport, PDTransport

INSTRUMENTATION_NAME = "pdclient"
ATTRIBUTE_PREFIX = "pdclient."

_T = TypeVar("_T")


class OTelObserver(PDObserver):
    """Records the spans above for every call of the clients it is passed to."""

    def __init__(self, tracer_provider: Any | None = None) -> None:
        try:
            self._trace = importlib.import_module("opentelemetry.trace")
        except ImportError:
            raise ImportError(
                "OpenTelemetry is not installed: pip install 'pdclient[otel]' (or opentelemetry-api)"
            ) from None
        from . import __version__

        self._tracer = self._trace.get_tracer(INSTRUMENTATION_NAME, __version__, tracer_provider=tracer_provider)

    def on_call_start(self, call: CallView) -> None:
        if call.route == "passthrough":
            return
        call.data[self] = self._tracer.start_span(
            f"pdclient.{call.route}",
            kind=self._trace.SpanKind.INTERNAL,
            attributes={"pdclient.route": call.route, "url.full": _url(call.request)},
        )

    def on_leg_start(self, call: CallView, leg: LegView) -> None:
        parent = call.data.get(self)
        if parent is None:
            return
        url = leg.request.url
        call.data[(self, leg.name)] = self._tracer.start_span(
            f"pdclient.{leg.name}",
            context=self._trace.set_span_in_context(parent),
            kind=self._trace.SpanKind.CLIENT,
            attributes={
                "pdclient.leg": leg.name,
                "pdclient.attempt": leg.attempt,
                "http.request.method": leg.request.method,
                "url.full": _url(leg.request),
                "server.address": url.host,
                "server.port": url.port or (443 if url.scheme == "https" else 80),
            },
        )

    def on_leg_end(self, call: CallView, leg: LegView, status: int | None, error: BaseException | None) -> None:
        span = call.data.pop((self, leg.name), None)
        if span is None:
            return
        if status is not None:
            span.set_attribute("http.response.status_code", status)
            if status >= 400:
                span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, f"HTTP {status}"))
        if error is not None:
            span.record_exception(error)
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        span.end()

    def on_call_end(self, call: CallView, trace: PDTrace) -> None:
        span = call.data.pop(self, None)
        if span is None:
            return
        for name, value in trace.model_dump(exclude_none=True, exclude={"migrations"}, mode="json").items():
            span.set_attribute(ATTRIBUTE_PREFIX + name, value)
        span.set_attribute(ATTRIBUTE_PREFIX + "migrations", len(trace.migrations))
        for moved in trace.migrations:
            attributes = {ATTRIBUTE_PREFIX + k: v for k, v in moved.model_dump(exclude_none=True).items()}
            span.add_event("pdclient.migration", attributes=attributes)
        if trace.outcome in (Outcome.FAILED, Outcome.REFUSED):
            span.set_status(self._trace.Status(self._trace.StatusCode.ERROR, trace.error or trace.outcome.value))
        span.end()


def _url(request: httpx.Request) -> str:
    # A leg request may carry an empty query ("...?"): not worth showing in a span.
    return str(request.url if request.url.query else request.url.copy_with(query=None))


def instrument(client: _T, *, tracer_provider: Any | None = None) -> _T:
    """A copy of ``client`` whose P/D calls record spans (the original is unchanged).

    ``client`` is a ``PDChatClient`` / ``AsyncPDChatClient`` (instrumented as
    ``client.with_options(observers=[..., OTelObserver(tracer_provider)])``) or an
    ``httpx.Client`` / ``httpx.AsyncClient`` built on a ``PDTransport`` /
    ``AsyncPDTransport`` (a new httpx client on an instrumented transport sharing its
    connections). A client that already records spans is returned as it is.
    """
    if isinstance(client, _PDClient):
        options = client.pd_options
        if any(isinstance(o, OTelObserver) for o in options.observers):
            return client
        observers = [*options.observers, OTelObserver(tracer_provider)]
        return client.with_options(observers=observers)
    transport = getattr(client, "_transport", None)  # httpx has no public getter for it
    if isinstance(client, httpx.Client | httpx.AsyncClient) and isinstance(transport, PDTransport | AsyncPDTransport):
        options = transport.options
        if any(isinstance(o, OTelObserver) for o in options.observers):
            return client
        derived = transport.with_options(options.replace(observers=[*options.observers, OTelObserver(tracer_provider)]))
        return type(client)(transport=derived, timeout=client.timeout, follow_redirects=client.follow_redirects)  # type: ignore[arg-type]
    raise PDConfigError(
        "instrument() takes a PDChatClient, an AsyncPDChatClient, or an httpx client whose transport is a "
        f"PDTransport; got {type(client).__name__}"
    )


__all__ = ["OTelObserver", "instrument"]
