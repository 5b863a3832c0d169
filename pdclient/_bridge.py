"""Today's ``AsyncPDTransport`` seen through the issue-10 surface: the one place to port.

Issue 10 (in progress) gives the transports ``options=PDOptions(observers=[...])``, fires
the five events of ``_observe`` from inside them and adds ``PDTrace.outcome``. Until it
lands, this module gives ``pdclient serve`` and ``pdclient.metrics`` that surface on the
current transport without touching it:

- ``make_transport``: an ``AsyncPDTransport`` whose calls fire the observer events. The
  call events and the first byte are fired around the transport, the leg events by a
  wrapper on its leg transport; the call's trace arrives through ``on_trace``.
- ``outcome_of(trace)``: ``PDTrace.outcome``, derived from today's ``fallback`` text.
- ``endpoint_states(obj)``: each endpoint's breaker state and in-flight count.

Porting when issue 10 lands: ``make_transport`` becomes ``AsyncPDTransport(
prefill_base_url=..., decode_base_url=..., options=PDOptions(observers=..., **options),
leg_transport=...)``, ``outcome_of(trace)`` becomes ``trace.outcome``, ``endpoint_states``
reads wherever the pools then live, and the rest of this module goes.
"""

from __future__ import annotations

import contextvars
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import httpx

from . import _handoff as plan
from ._endpoints import BreakerSettings
from ._observe import Observers, PDObserver
from ._retry import RetrySettings
from ._trace import PDTrace
from ._transport import AsyncPDTransport, PDSettings

OUTCOMES = ("disaggregated", "decode_only", "prefill_failed", "refused", "failed", "passthrough")

_PREFILL_MARKER = b'"do_remote_decode":true'
"""In the prefill leg's body (orjson, compact) and in no other leg's: names the leg."""


def transport_options(
    *,
    on_prefill_failure: str,
    routing: str,
    breaker_failures: int,
    breaker_cooldown: float,
    prefill_attempts: int,
    decode_attempts: int,
    backoff_initial: float,
    backoff_max: float,
    prefill_timeout: float | None,
    reuse_secret: str | None,
) -> dict[str, Any]:
    """Flat client options (as flags and config files spell them) as today's transport keywords."""
    return {
        "on_prefill_failure": on_prefill_failure,
        "routing": routing,
        "breaker": BreakerSettings(failures=breaker_failures, cooldown=breaker_cooldown),
        "retries": RetrySettings(
            prefill_attempts=prefill_attempts,
            decode_attempts=decode_attempts,
            backoff_initial=backoff_initial,
            backoff_max=backoff_max,
            prefill_timeout=prefill_timeout,
        ),
        "reuse_secret": reuse_secret,
    }


def check_options(prefill: Iterable[str], decode: Iterable[str], options: Mapping[str, Any]) -> None:
    """Raise PDConfigError for options the transport would refuse, without building one."""
    PDSettings.resolve(list(prefill), list(decode), **options)


def make_transport(
    prefill: Iterable[str],
    decode: Iterable[str],
    options: Mapping[str, Any],
    observers: Iterable[PDObserver],
    leg_transport: httpx.AsyncBaseTransport,
) -> ObservedTransport:
    """An async P/D transport that reports each call to ``observers``."""
    fan_out = Observers(observers)
    inner = AsyncPDTransport(
        list(prefill), list(decode), leg_transport=_LegTap(leg_transport, fan_out), on_trace=_keep_trace, **options
    )
    return ObservedTransport(inner, fan_out)


class EndpointState(NamedTuple):
    leg: str
    """``prefill`` or ``decode``."""
    url: str
    state: str
    """The circuit breaker's: ``closed``, ``open`` or ``half-open``."""
    admitted: bool
    """Whether the breaker lets a request through now."""
    in_flight: int


def endpoint_states(source: object) -> list[EndpointState]:
    """The endpoints of a transport (or of a client built on one) and their breakers."""
    transport = getattr(source, "inner", source)
    transport = getattr(getattr(transport, "_client", transport), "_transport", transport)
    settings = getattr(transport, "settings", None)
    if not isinstance(settings, PDSettings):
        raise TypeError(f"expected a pdclient client or transport, got {type(source).__name__}")
    return [
        EndpointState(pool.leg, e.url, e.state, e.admits(), e.in_flight)
        for pool in (settings.prefill, settings.decode)
        for e in pool.endpoints
    ]


def outcome_of(trace: PDTrace) -> str:
    """One of ``OUTCOMES`` for a finished call, from today's ``fallback`` text."""
    reason = trace.fallback or ""
    if trace.route == "passthrough":
        return "failed" if reason else "passthrough"
    if not reason or reason.startswith("ids not forwarded"):
        return "disaggregated"  # the KV moved; only the ids were not forwarded
    if reason.startswith("refused:"):
        return "refused"
    if reason.startswith(("prefill failed, decode-only", "prefill failed, sent to")):
        return "decode_only"
    if reason.startswith(("prefill failed", "prefill leg answered")):
        return "prefill_failed"
    return "failed"


# -- the event bridge ------------------------------------------------------------------


@dataclass(eq=False)
class _Call:
    """A ``CallView``, plus what the bridge needs to end the call once."""

    request_id: str
    route: str
    request: httpx.Request
    relative_path: str
    started: float = field(default_factory=time.perf_counter)
    data: dict[Any, Any] = field(default_factory=dict)
    trace: PDTrace | None = None
    ended: bool = False
    decode_url: str | None = None
    attempts: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class _Leg:
    """A ``LegView``."""

    name: str
    url: str
    attempt: int
    request: httpx.Request
    sent_at: float


# The call being sent: read by the leg tap and by on_trace, which run inside the transport.
_current: contextvars.ContextVar[_Call | None] = contextvars.ContextVar("pdclient_bridge_call", default=None)


def _keep_trace(trace: PDTrace) -> None:
    call = _current.get()
    if call is not None:
        call.trace = trace


class ObservedTransport(httpx.AsyncBaseTransport):
    """``AsyncPDTransport`` with the observer events fired around it."""

    def __init__(self, inner: AsyncPDTransport, observers: Observers) -> None:
        self.inner = inner
        self._observers = observers

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        request_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        request.headers["x-request-id"] = request_id  # the transport then uses the same id
        url = str(request.url.copy_with(query=None))
        base = self.inner.settings.decode.base_of(url) or url
        relative = url[len(base) :]
        kind = plan.route_kind(relative) if request.method == "POST" else None
        call = _Call(request_id, kind.value if kind else "passthrough", request, relative)
        self._observers.call_start(call)
        token = _current.set(call)
        try:
            response = await self.inner.handle_async_request(request)
        except BaseException as exc:
            self._end(call, None, exc)
            raise
        finally:
            _current.reset(token)
        if call.trace is not None:  # ended without a decode leg (refused, prefill failed, ...)
            self._end(call, response, None)
            return response
        stream = _ObservedStream(response, call, self)
        return httpx.Response(
            response.status_code, headers=response.headers, stream=stream, extensions=response.extensions
        )

    def _end(self, call: _Call, response: httpx.Response | None, error: BaseException | None) -> None:
        if call.ended:
            return
        call.ended = True
        trace = call.trace or PDTrace(
            request_id=call.request_id,
            route=call.route,
            decode_url=call.decode_url,
            fallback=None if error is None else f"decode leg not opened: {type(error).__name__}: {error}",
        )
        failed_leg = response.headers.get("x-pd-failed-leg") if response is not None else None
        if response is not None and response.status_code >= 400 and trace.fallback is None:
            # Today's trace says nothing when a leg's own error status is passed on.
            leg = failed_leg or "decode"
            trace = trace.model_copy(update={"fallback": f"{leg} leg answered HTTP {response.status_code}"})
        self._observers.call_end(call, trace)

    async def aclose(self) -> None:
        await self.inner.aclose()


class _ObservedStream(httpx.AsyncByteStream):
    """The decode body: the first byte and the end of the call are reported from here."""

    def __init__(self, response: httpx.Response, call: _Call, owner: ObservedTransport) -> None:
        self._response = response
        self._call = call
        self._owner = owner
        self._first = True

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.stream:  # type: ignore[union-attr]
            if self._first and chunk:
                self._first = False
                self._owner._observers.first_byte(self._call)
            yield chunk

    async def aclose(self) -> None:
        token = _current.set(self._call)  # the transport delivers the trace while closing
        try:
            await self._response.aclose()
        finally:
            _current.reset(token)
            self._owner._end(self._call, self._response, None)


class _LegTap(httpx.AsyncBaseTransport):
    """Wraps the leg transport: each leg request is one on_leg_start / on_leg_end pair."""

    def __init__(self, inner: httpx.AsyncBaseTransport, observers: Observers) -> None:
        self._inner = inner
        self._observers = observers

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        call = _current.get()
        if call is None:
            return await self._inner.handle_async_request(request)
        if call.route != "passthrough" and _PREFILL_MARKER in request.content:
            name = "prefill"
        else:
            # A decode sent after the call ended is the one-token release of its KV blocks.
            name = "release" if call.ended else "decode"
        url = str(request.url.copy_with(query=None))
        base = url[: -len(call.relative_path)] if call.relative_path and url.endswith(call.relative_path) else url
        if name == "decode":
            call.decode_url = base
        call.attempts[name] += 1
        leg = _Leg(name, base, call.attempts[name], request, time.perf_counter())
        self._observers.leg_start(call, leg)
        try:
            response = await self._inner.handle_async_request(request)
        except BaseException as exc:
            self._observers.leg_end(call, leg, None, exc)
            raise
        stream = _LegStream(response, call, leg, self._observers)
        return httpx.Response(
            response.status_code, headers=response.headers, stream=stream, extensions=response.extensions
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


class _LegStream(httpx.AsyncByteStream):
    def __init__(self, response: httpx.Response, call: _Call, leg: _Leg, observers: Observers) -> None:
        self._response = response
        self._call = call
        self._leg = leg
        self._observers = observers
        self._error: BaseException | None = None
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.stream:  # type: ignore[union-attr]
                yield chunk
        except Exception as exc:
            self._error = exc
            raise

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._response.aclose()
        finally:
            self._observers.leg_end(self._call, self._leg, self._response.status_code, self._error)
