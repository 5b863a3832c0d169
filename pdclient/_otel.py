"""Optional OpenTelemetry spans for P/D calls (the ``pdclient[otel]`` extra).

``instrument(client)`` makes every chat or completions call of a ``PDChatClient`` /
``AsyncPDChatClient`` (or of an ``httpx`` client built on ``PDTransport``) record::

    pdclient.chat                 one span per call, PDTrace fields as pdclient.* attributes
    ├── pdclient.prefill          one span per prefill attempt (retries show as siblings)
    └── pdclient.decode           from sending the decode request until its body is closed

The spans nest under whatever span is current when the call is made, for example the
``chat <model>`` span of ``opentelemetry-instrumentation-openai-v2``, which still sees one
call: the split into two legs happens below the openai SDK, in the transport.

Nothing here imports OpenTelemetry until ``instrument()`` is called, so pdclient without
the extra installed never imports it. Requests that are not a P/D handoff (models,
embeddings, ...) get no spans; httpx instrumentation covers those.
"""

from __future__ import annotations

import contextvars
import importlib
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from . import _handoff as plan
from ._errors import PDSetupError
from ._trace import PDTrace
from ._transport import AsyncPDTransport, PDSettings, PDTransport

INSTRUMENTATION_NAME = "pdclient"
ATTRIBUTE_PREFIX = "pdclient."

_T = TypeVar("_T")


@dataclass
class _Call:
    """The span of one P/D call and what its legs report back to it."""

    span: Any
    decode_sent_at: float | None = None
    first_byte_at: float | None = None
    legs: list[Any] = field(default_factory=list)


# The call being sent, visible to the leg transport: set around the inner transport's
# handle_request, which sends both legs in the same thread (sync) or task (async).
_current: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("pdclient_otel_call", default=None)


class _OTel:
    """The OpenTelemetry API, imported once the user asks for spans."""

    def __init__(self, tracer_provider: Any | None) -> None:
        try:
            self.trace = importlib.import_module("opentelemetry.trace")
        except ImportError:
            raise PDSetupError(
                "OpenTelemetry is not installed: pip install 'pdclient[otel]' (or opentelemetry-api)"
            ) from None
        from . import __version__

        self.tracer = self.trace.get_tracer(INSTRUMENTATION_NAME, __version__, tracer_provider=tracer_provider)

    def start_call(self, kind: plan.Kind, request: httpx.Request) -> _Call:
        span = self.tracer.start_span(
            f"pdclient.{kind.value}",
            kind=self.trace.SpanKind.INTERNAL,
            attributes={"pdclient.route": kind.value, "url.full": _url(request)},
        )
        return _Call(span=span)

    def start_leg(self, call: _Call, leg: str, request: httpx.Request) -> Any:
        context = self.trace.set_span_in_context(call.span)
        span = self.tracer.start_span(
            f"pdclient.{leg}",
            context=context,
            kind=self.trace.SpanKind.CLIENT,
            attributes={
                "pdclient.leg": leg,
                "http.request.method": request.method,
                "url.full": _url(request),
                "server.address": request.url.host,
                "server.port": request.url.port or (443 if request.url.scheme == "https" else 80),
            },
        )
        call.legs.append(span)
        return span

    def fail(self, span: Any, error: BaseException) -> None:
        span.record_exception(error)
        span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, f"{type(error).__name__}: {error}"))

    def leg_status(self, span: Any, status: int) -> None:
        span.set_attribute("http.response.status_code", status)
        if status >= 400:
            span.set_status(self.trace.Status(self.trace.StatusCode.ERROR, f"HTTP {status}"))

    def end_call(self, call: _Call, response: httpx.Response) -> None:
        trace = PDTrace.from_headers(response.headers)
        first_byte_ms = trace.decode_first_byte_ms
        if first_byte_ms is None and call.first_byte_at is not None and call.decode_sent_at is not None:
            first_byte_ms = (call.first_byte_at - call.decode_sent_at) * 1000
        attributes = trace.model_dump(exclude_none=True)
        if first_byte_ms is not None:
            attributes["decode_first_byte_ms"] = first_byte_ms
        for name, value in attributes.items():
            call.span.set_attribute(ATTRIBUTE_PREFIX + name, value)
        failed_leg = response.headers.get("x-pd-failed-leg")
        if failed_leg is not None:
            call.span.set_attribute("pdclient.failed_leg", failed_leg)
        self.leg_status(call.span, response.status_code)
        call.span.end()


def _url(request: httpx.Request) -> str:
    # A leg request may carry an empty query ("...?"): not worth showing in a span.
    return str(request.url if request.url.query else request.url.copy_with(query=None))


def _leg_name(settings: PDSettings, request: httpx.Request) -> str:
    url = str(request.url.copy_with(query=None))
    return "prefill" if settings.prefill.base_of(url) is not None else "decode"


def _kind(settings: PDSettings, request: httpx.Request) -> plan.Kind | None:
    """The handoff this request takes (as ``_transport._Handoff`` decides), or None."""
    if request.method != "POST":
        return None
    url = str(request.url.copy_with(query=None))
    base = settings.decode.base_of(url)
    return None if base is None else plan.route_kind(url[len(base) :])


# -- leg transports: a span per leg request -------------------------------------------


class _LegStream(httpx.SyncByteStream):
    def __init__(self, inner: Any, end: Any) -> None:
        self._inner, self._end, self._done = inner, end, False

    def __iter__(self) -> Iterator[bytes]:
        yield from self._inner

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            if not self._done:
                self._done = True
                self._end()


class _AsyncLegStream(httpx.AsyncByteStream):
    def __init__(self, inner: Any, end: Any) -> None:
        self._inner, self._end, self._done = inner, end, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            if not self._done:
                self._done = True
                self._end()


class _LegSpans:
    """Shared by the sync and async leg transports: opens and closes one leg's span."""

    def __init__(self, otel: _OTel, settings: PDSettings) -> None:
        self.otel = otel
        self.settings = settings

    def open(self, request: httpx.Request) -> tuple[_Call, Any] | None:
        call = _current.get()
        if call is None:
            return None  # not inside an instrumented call (e.g. a background KV release)
        leg = _leg_name(self.settings, request)
        span = self.otel.start_leg(call, leg, request)
        if leg == "decode":
            call.decode_sent_at = time.perf_counter()
        return call, span

    def response(self, opened: tuple[_Call, Any], response: httpx.Response, stream: type[Any]) -> httpx.Response:
        _, span = opened
        self.otel.leg_status(span, response.status_code)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            stream=stream(response.stream, span.end),
            extensions=response.extensions,
        )


class _SpanLegTransport(httpx.BaseTransport):
    def __init__(self, inner: httpx.BaseTransport, spans: _LegSpans) -> None:
        self.inner = inner
        self.spans = spans

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        opened = self.spans.open(request)
        if opened is None:
            return self.inner.handle_request(request)
        try:
            response = self.inner.handle_request(request)
        except BaseException as exc:
            self.spans.otel.fail(opened[1], exc)
            opened[1].end()
            raise
        return self.spans.response(opened, response, _LegStream)

    def close(self) -> None:
        self.inner.close()


class _AsyncSpanLegTransport(httpx.AsyncBaseTransport):
    def __init__(self, inner: httpx.AsyncBaseTransport, spans: _LegSpans) -> None:
        self.inner = inner
        self.spans = spans

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        opened = self.spans.open(request)
        if opened is None:
            return await self.inner.handle_async_request(request)
        try:
            response = await self.inner.handle_async_request(request)
        except BaseException as exc:
            self.spans.otel.fail(opened[1], exc)
            opened[1].end()
            raise
        return self.spans.response(opened, response, _AsyncLegStream)

    async def aclose(self) -> None:
        await self.inner.aclose()


# -- call transports: a span per P/D call ---------------------------------------------


class _CallStream(httpx.SyncByteStream):
    """The caller's response body; the call's span ends when it is closed."""

    def __init__(self, inner: Any, call: _Call, end: Any) -> None:
        self._inner, self._call, self._end, self._done = inner, call, end, False

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._inner:
            if self._call.first_byte_at is None:
                self._call.first_byte_at = time.perf_counter()
            yield chunk

    def close(self) -> None:
        try:
            self._inner.close()
        finally:
            if not self._done:
                self._done = True
                self._end()


class _AsyncCallStream(httpx.AsyncByteStream):
    def __init__(self, inner: Any, call: _Call, end: Any) -> None:
        self._inner, self._call, self._end, self._done = inner, call, end, False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            if self._call.first_byte_at is None:
                self._call.first_byte_at = time.perf_counter()
            yield chunk

    async def aclose(self) -> None:
        try:
            await self._inner.aclose()
        finally:
            if not self._done:
                self._done = True
                self._end()


def _wrap_response(otel: _OTel, call: _Call, response: httpx.Response, stream: type[Any]) -> httpx.Response:
    return httpx.Response(
        response.status_code,
        headers=response.headers,
        stream=stream(response.stream, call, lambda: otel.end_call(call, response)),
        extensions=response.extensions,
    )


class OTelPDTransport(PDTransport):
    """``PDTransport`` that records a span per call and per leg (see the module docstring)."""

    def __init__(self, *args: Any, tracer_provider: Any | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        legs = self._legs
        if isinstance(legs, _SpanLegTransport):  # a copy: keep the tracer, follow the new settings
            self._otel = legs.spans.otel if tracer_provider is None else _OTel(tracer_provider)
            legs = legs.inner
        else:
            self._otel = _OTel(tracer_provider)
        self._legs = _SpanLegTransport(legs, _LegSpans(self._otel, self.settings))

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        kind = _kind(self.settings, request)
        if kind is None:
            return super().handle_request(request)
        call = self._otel.start_call(kind, request)
        token = _current.set(call)
        try:
            with self._otel.trace.use_span(call.span, end_on_exit=False, record_exception=False):
                response = super().handle_request(request)
        except BaseException as exc:
            self._otel.fail(call.span, exc)
            call.span.end()
            raise
        finally:
            _current.reset(token)
        return _wrap_response(self._otel, call, response, _CallStream)


class AsyncOTelPDTransport(AsyncPDTransport):
    """Async twin of ``OTelPDTransport``."""

    def __init__(self, *args: Any, tracer_provider: Any | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        legs = self._legs
        if isinstance(legs, _AsyncSpanLegTransport):  # a copy: keep the tracer, follow the new settings
            self._otel = legs.spans.otel if tracer_provider is None else _OTel(tracer_provider)
            legs = legs.inner
        else:
            self._otel = _OTel(tracer_provider)
        self._legs = _AsyncSpanLegTransport(legs, _LegSpans(self._otel, self.settings))

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        kind = _kind(self.settings, request)
        if kind is None:
            return await super().handle_async_request(request)
        call = self._otel.start_call(kind, request)
        token = _current.set(call)
        try:
            with self._otel.trace.use_span(call.span, end_on_exit=False, record_exception=False):
                response = await super().handle_async_request(request)
        except BaseException as exc:
            self._otel.fail(call.span, exc)
            call.span.end()
            raise
        finally:
            _current.reset(token)
        return _wrap_response(self._otel, call, response, _AsyncCallStream)


def instrument(client: _T, *, tracer_provider: Any | None = None) -> _T:
    """Record OpenTelemetry spans for every P/D call made through ``client``; returns it.

    ``client`` is a ``PDChatClient`` / ``AsyncPDChatClient`` or an ``httpx.Client`` /
    ``httpx.AsyncClient`` whose transport is a ``PDTransport`` / ``AsyncPDTransport``.
    Idempotent. Spans go to ``tracer_provider`` (default: the global one). Raises
    ``PDSetupError`` when OpenTelemetry is not installed.
    """
    http: Any = getattr(client, "_client", client)  # openai clients keep their httpx client there
    transport = getattr(http, "_transport", None)
    if isinstance(transport, OTelPDTransport | AsyncOTelPDTransport):
        return client
    replacement: PDTransport | AsyncPDTransport
    if isinstance(transport, PDTransport):
        replacement = OTelPDTransport(
            settings=transport.settings, leg_transport=transport._legs, tracer_provider=tracer_provider
        )
    elif isinstance(transport, AsyncPDTransport):
        replacement = AsyncOTelPDTransport(
            settings=transport.settings, leg_transport=transport._legs, tracer_provider=tracer_provider
        )
    else:
        raise TypeError(
            "instrument() takes a PDChatClient, an AsyncPDChatClient, or an httpx client whose "
            f"transport is a PDTransport; got {type(client).__name__} with transport {type(transport).__name__}"
        )
    # A subclass, so the client's copy()/with_options() still recognise it as a P/D transport.
    http._transport = replacement
    return client


__all__ = ["AsyncOTelPDTransport", "OTelPDTransport", "instrument"]
