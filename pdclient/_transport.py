"""The P/D handoff as an httpx transport: the seam between the openai SDK and the servers.

``PDTransport`` / ``AsyncPDTransport`` receive the plain HTTP request the SDK built for
its base URL (the decode endpoint). POST ``/chat/completions`` and ``/completions`` are
split into a prefill leg and a decode leg; every other request goes to decode unchanged.
The decode response, streamed or not, is handed back to the SDK as it arrives, so
``Stream``, ``with_raw_response`` and ``with_streaming_response`` work as usual.

Both twins drive the same ``_Handoff`` object, which does all the planning; they differ
only by ``await``.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import httpx
import orjson

from . import _handoff as plan
from ._endpoints import DECODE_ENV, PREFILL_ENV, EndpointPool, URLArg, resolve_urls
from ._errors import PDConfigError
from ._handoff import Kind, PrefillResult
from ._trace import PDTrace, TraceCallback, deliver

logger = logging.getLogger("pdclient")

PrefillFailurePolicy = Literal["decode", "fail"]
PREFILL_FAILURE_POLICIES: tuple[str, ...] = ("decode", "fail")

# Hop-by-hop or derived headers that must not be copied onto a leg's new request.
_DROPPED_REQUEST_HEADERS = ("host", "content-length", "transfer-encoding", "connection")
_FAILED_LEG_HEADER = "x-pd-failed-leg"


@dataclass(frozen=True)
class PDSettings:
    """Everything a transport needs, resolved and validated once."""

    prefill: EndpointPool
    decode: EndpointPool
    on_trace: TraceCallback | None = None
    on_prefill_failure: PrefillFailurePolicy = "decode"

    @classmethod
    def resolve(
        cls,
        prefill_base_url: URLArg = None,
        decode_base_url: URLArg = None,
        *,
        on_trace: TraceCallback | None = None,
        on_prefill_failure: str = "decode",
    ) -> PDSettings:
        if on_prefill_failure not in PREFILL_FAILURE_POLICIES:
            raise PDConfigError(
                f"on_prefill_failure must be one of {PREFILL_FAILURE_POLICIES}, got {on_prefill_failure!r}"
            )
        if on_trace is not None and not callable(on_trace):
            raise PDConfigError(f"on_trace must be callable, got {type(on_trace).__name__}")
        return cls(
            prefill=EndpointPool(resolve_urls(prefill_base_url, argument="prefill_base_url", env=PREFILL_ENV)),
            decode=EndpointPool(resolve_urls(decode_base_url, argument="decode_base_url", env=DECODE_ENV)),
            on_trace=on_trace,
            on_prefill_failure=on_prefill_failure,  # type: ignore[arg-type]
        )


def _json_error(status: int, message: str, leg: str, trace: PDTrace) -> httpx.Response:
    """A response the openai SDK turns into its usual APIStatusError, naming the cause."""
    body = {"error": {"message": f"pdclient: {message}", "type": "pdclient_error", "code": status}}
    headers = {**trace.to_headers(), _FAILED_LEG_HEADER: leg, "content-type": "application/json"}
    return httpx.Response(status, headers=headers, content=orjson.dumps(body))


class _Handoff:
    """One call's planning and bookkeeping; the transports only move bytes."""

    def __init__(self, settings: PDSettings, request: httpx.Request) -> None:
        self.settings = settings
        self.request = request
        self.request_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        self.started = time.perf_counter()
        self.kind: Kind | None = None
        self.relative_path = ""
        self.body: dict[str, Any] = {}
        self.prefill_url: str | None = None
        self.prefill_ms: float | None = None
        self.prefill: PrefillResult | None = None
        self.fallback: str | None = None
        self.cpu_seconds = 0.0
        self.decode_url = settings.decode.pick()
        self.decode_sent_at = 0.0
        self.decode_headers_ms: float | None = None

        url = str(request.url.copy_with(query=None))
        base = settings.decode.base_of(url)
        if base is None:
            return  # not under our API base: pass through untouched
        self.relative_path = url[len(base) :]
        if request.method == "POST":
            self.kind = plan.route_kind(self.relative_path)

    # -- planning ------------------------------------------------------------------

    def refusal(self) -> httpx.Response | None:
        """Parse the caller's body; a 400 response if it cannot take a P/D handoff."""
        if self.kind is None:
            return None
        try:
            body = orjson.loads(self.request.content)
        except orjson.JSONDecodeError as exc:
            return _json_error(400, f"request body is not JSON: {exc}", "client", self.trace())
        if not isinstance(body, dict):
            return _json_error(400, "request body is not a JSON object", "client", self.trace())
        self.body = body
        reason = plan.handoff_refusal(self.kind, body)
        return None if reason is None else _json_error(400, reason, "client", self.trace())

    def prefill_request(self) -> httpx.Request:
        assert self.kind is not None
        self.prefill_url = self.settings.prefill.pick()
        body = plan.plan_prefill(self.kind, self.body)
        request = self._leg_request(self.prefill_url, orjson.dumps(body))
        request.headers["accept"] = "application/json"
        return request

    def take_prefill(self, response: httpx.Response) -> httpx.Response | None:
        """Read the prefill result; a response to return to the caller if the call ends here."""
        assert self.kind is not None
        self.prefill_ms = (time.perf_counter() - self.started) * 1000
        status = response.status_code
        if status >= 400 and status not in (408, 429) and status < 500:
            # The request itself is wrong (bad model, messages, ...): the decode leg would
            # refuse it too, so the caller gets the prefill's own error.
            return self._pass_error(response, "prefill")
        if status >= 400:
            return self.prefill_failed(f"HTTP {status}: {response.text[:200]}", response)
        cpu_start = time.thread_time()
        try:
            payload = orjson.loads(response.content)
        except orjson.JSONDecodeError:
            payload = None
        self.prefill = plan.read_prefill(self.kind, payload)
        self.cpu_seconds += time.thread_time() - cpu_start
        if self.prefill.problem is not None:
            self.fallback = f"ids not forwarded: {self.prefill.problem}"
        return None

    def prefill_failed(self, reason: str, response: httpx.Response | None = None) -> httpx.Response | None:
        """Apply the failure policy; a response to return when it says to fail."""
        if self.prefill_ms is None:
            self.prefill_ms = (time.perf_counter() - self.started) * 1000
        if self.settings.on_prefill_failure == "fail":
            self.fallback = f"prefill failed: {reason}"
            if response is not None:
                return self._pass_error(response, "prefill")
            return _json_error(502, f"prefill leg failed: {reason}", "prefill", self.trace())
        self.fallback = f"prefill failed, decode-only: {reason}"
        self.prefill = None
        return None

    def decode_request(self) -> httpx.Request:
        if self.kind is None:
            return self._leg_request(self.decode_url, self.request.content)
        cpu_start = time.thread_time()
        no_ids_reason = plan.ids_not_forwarded_because(self.kind, self.body)
        if no_ids_reason is not None and self.prefill is not None and self.fallback is None:
            self.fallback = f"ids not forwarded: {no_ids_reason}"
        body = plan.plan_decode(self.kind, self.body, self.prefill, forward_ids=no_ids_reason is None)
        content = orjson.dumps(body)
        self.cpu_seconds += time.thread_time() - cpu_start
        return self._leg_request(self.decode_url, content)

    def _leg_request(self, base: str, content: bytes) -> httpx.Request:
        headers = self.request.headers.copy()
        for name in _DROPPED_REQUEST_HEADERS:
            headers.pop(name, None)
        headers["x-request-id"] = self.request_id
        url = httpx.URL(base + self.relative_path, query=self.request.url.query) if self.relative_path else None
        return httpx.Request(
            self.request.method,
            url or self.request.url,
            headers=headers,
            content=content,
            extensions=self.request.extensions,
        )

    # -- results -------------------------------------------------------------------

    def forwarded_tokens(self) -> int:
        if self.prefill is None or self.prefill.prompt_token_ids is None or self.kind is None:
            return 0
        if plan.ids_not_forwarded_because(self.kind, self.body) is not None:
            return 0
        return len(self.prefill.prompt_token_ids)

    def trace(self, decode_first_byte_ms: float | None = None) -> PDTrace:
        return PDTrace(
            request_id=self.request_id,
            route=self.kind.value if self.kind else "passthrough",
            prefill_url=self.prefill_url,
            decode_url=self.decode_url if self.kind or self.decode_sent_at else None,
            prefill_ms=self.prefill_ms,
            forwarded_tokens=self.forwarded_tokens(),
            handoff_cpu_ms=self.cpu_seconds * 1000 if self.kind else None,
            fallback=self.fallback,
            decode_headers_ms=self.decode_headers_ms,
            decode_first_byte_ms=decode_first_byte_ms,
        )

    def _pass_error(self, response: httpx.Response, leg: str) -> httpx.Response:
        headers = httpx.Headers(response.headers)
        headers.update({**self.trace().to_headers(), _FAILED_LEG_HEADER: leg})
        for name in ("content-length", "content-encoding", "transfer-encoding"):
            headers.pop(name, None)
        return httpx.Response(response.status_code, headers=headers, content=response.content)

    def decode_response(
        self, response: httpx.Response, stream: httpx.SyncByteStream | httpx.AsyncByteStream
    ) -> httpx.Response:
        self.decode_headers_ms = (time.perf_counter() - self.decode_sent_at) * 1000
        trace = self.trace()
        headers = httpx.Headers(response.headers)
        headers.update(trace.to_headers())
        if response.status_code >= 400:
            headers[_FAILED_LEG_HEADER] = "decode"
        return httpx.Response(response.status_code, headers=headers, stream=stream, extensions=response.extensions)

    def finish(self, first_byte_at: float | None) -> None:
        if self.kind is None:
            return  # a pass-through request is not a handoff: nothing to report
        first_byte_ms = None if first_byte_at is None else (first_byte_at - self.decode_sent_at) * 1000
        deliver(self.trace(decode_first_byte_ms=first_byte_ms), self.settings.on_trace)


class _TracedStream(httpx.SyncByteStream):
    """The decode body, passed through chunk by chunk; the trace is delivered on close."""

    def __init__(self, response: httpx.Response, handoff: _Handoff) -> None:
        self._response = response
        self._handoff = handoff
        self._first_byte_at: float | None = None
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self._response.stream:  # type: ignore[union-attr]
            if self._first_byte_at is None:
                self._first_byte_at = time.perf_counter()
            yield chunk

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._response.close()
        finally:
            self._handoff.finish(self._first_byte_at)


class _AsyncTracedStream(httpx.AsyncByteStream):
    """Async twin of ``_TracedStream``."""

    def __init__(self, response: httpx.Response, handoff: _Handoff) -> None:
        self._response = response
        self._handoff = handoff
        self._first_byte_at: float | None = None
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._response.stream:  # type: ignore[union-attr]
            if self._first_byte_at is None:
                self._first_byte_at = time.perf_counter()
            yield chunk

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._response.aclose()
        finally:
            self._handoff.finish(self._first_byte_at)


class PDTransport(httpx.BaseTransport):
    """httpx transport that splits chat and completions calls into prefill and decode legs.

    Use it with any openai client whose ``base_url`` is one of the decode URLs::

        transport = PDTransport(prefill_base_url="http://p:8100/v1", decode_base_url="http://d:8200/v1")
        client = openai.OpenAI(base_url="http://d:8200/v1", api_key="-", http_client=httpx.Client(transport=transport))

    ``leg_transport`` sends both legs (default: a pooled ``httpx.HTTPTransport``).
    """

    def __init__(
        self,
        prefill_base_url: URLArg = None,
        decode_base_url: URLArg = None,
        *,
        on_trace: TraceCallback | None = None,
        on_prefill_failure: PrefillFailurePolicy = "decode",
        leg_transport: httpx.BaseTransport | None = None,
        settings: PDSettings | None = None,
    ) -> None:
        self.settings = settings or PDSettings.resolve(
            prefill_base_url, decode_base_url, on_trace=on_trace, on_prefill_failure=on_prefill_failure
        )
        self._legs = leg_transport or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        handoff = _Handoff(self.settings, request)
        if handoff.kind is not None:
            request.read()
            refused = handoff.refusal()
            if refused is not None:
                return refused
            ended = self._run_prefill(handoff)
            if ended is not None:
                return ended
        decode_request = handoff.decode_request()
        handoff.decode_sent_at = time.perf_counter()
        response = self._legs.handle_request(decode_request)
        return handoff.decode_response(response, _TracedStream(response, handoff))

    def _run_prefill(self, handoff: _Handoff) -> httpx.Response | None:
        try:
            response = self._legs.handle_request(handoff.prefill_request())
            try:
                response.read()
            finally:
                response.close()
        except httpx.TransportError as exc:
            return handoff.prefill_failed(f"{type(exc).__name__}: {exc}")
        return handoff.take_prefill(response)

    def close(self) -> None:
        self._legs.close()


class AsyncPDTransport(httpx.AsyncBaseTransport):
    """Async twin of ``PDTransport``."""

    def __init__(
        self,
        prefill_base_url: URLArg = None,
        decode_base_url: URLArg = None,
        *,
        on_trace: TraceCallback | None = None,
        on_prefill_failure: PrefillFailurePolicy = "decode",
        leg_transport: httpx.AsyncBaseTransport | None = None,
        settings: PDSettings | None = None,
    ) -> None:
        self.settings = settings or PDSettings.resolve(
            prefill_base_url, decode_base_url, on_trace=on_trace, on_prefill_failure=on_prefill_failure
        )
        self._legs = leg_transport or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        handoff = _Handoff(self.settings, request)
        if handoff.kind is not None:
            await request.aread()
            refused = handoff.refusal()
            if refused is not None:
                return refused
            ended = await self._run_prefill(handoff)
            if ended is not None:
                return ended
        decode_request = handoff.decode_request()
        handoff.decode_sent_at = time.perf_counter()
        response = await self._legs.handle_async_request(decode_request)
        return handoff.decode_response(response, _AsyncTracedStream(response, handoff))

    async def _run_prefill(self, handoff: _Handoff) -> httpx.Response | None:
        try:
            response = await self._legs.handle_async_request(handoff.prefill_request())
            try:
                await response.aread()
            finally:
                await response.aclose()
        except httpx.TransportError as exc:
            return handoff.prefill_failed(f"{type(exc).__name__}: {exc}")
        return handoff.take_prefill(response)

    async def aclose(self) -> None:
        await self._legs.aclose()


__all__: Sequence[str] = ("PDTransport", "AsyncPDTransport", "PDSettings")
