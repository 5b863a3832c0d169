"""The P/D handoff as an httpx transport: the seam between the openai SDK and the servers.

``PDTransport`` / ``AsyncPDTransport`` receive the plain HTTP request the SDK built for
its base URL (a decode endpoint). POST ``/chat/completions`` and ``/completions`` are
split into a prefill leg and a decode leg; every other request goes to a decode endpoint
unchanged. The decode response, streamed or not, is handed back to the SDK as it
arrives, so ``Stream``, ``with_raw_response`` and ``with_streaming_response`` work.

All decisions are made by ``_Handoff`` (one per call), ``_handoff`` (pure planning) and
``_retry`` (retry policy). The two transports only move bytes and differ by ``await``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import orjson
import tenacity

from . import _handoff as plan
from . import _retry as retry
from ._endpoints import (
    DECODE_ENV,
    PREFILL_ENV,
    AllEndpointsOpen,
    BreakerSettings,
    Endpoint,
    EndpointPool,
    RoutingPolicy,
    URLArg,
    make_policy,
    normalise_url,
    resolve_urls,
)
from ._errors import PDConfigError
from ._handoff import Kind, PrefillResult
from ._retry import RetrySettings
from ._signing import SECRET_ENV, SIGNATURE_HEADER, signature
from ._trace import PDTrace, TraceCallback, deliver

logger = logging.getLogger("pdclient")

PREFILL_FAILURE_POLICIES = ("decode", "fail")
"""Besides these, ``on_prefill_failure`` may be the base URL of a fallback server."""

# Hop-by-hop or derived headers that must not be copied onto a leg's new request.
_DROPPED_REQUEST_HEADERS = ("host", "content-length", "transfer-encoding", "connection")
_FAILED_LEG_HEADER = "x-pd-failed-leg"


def _check_failure_policy(value: object, source: str) -> str:
    if value in PREFILL_FAILURE_POLICIES:
        return str(value)
    if isinstance(value, str) and value.startswith(("http://", "https://")):
        return normalise_url(value, source)
    raise PDConfigError(f"{source} must be one of {PREFILL_FAILURE_POLICIES} or a fallback base URL, got {value!r}")


@dataclass(frozen=True, eq=False)
class PDSettings:
    """Everything a transport needs, resolved and validated once; shared by client copies."""

    prefill: EndpointPool
    decode: EndpointPool
    on_trace: TraceCallback | None = None
    on_prefill_failure: str = "decode"
    retry: RetrySettings = field(default_factory=RetrySettings)
    routing: str | RoutingPolicy | None = None
    """As given; each pool holds its own policy object made from it."""
    reuse_secret: str | None = field(default=None, repr=False)
    """Signs every leg's request (X-PDClient-Signature) for servers guarded by the server patch."""

    @classmethod
    def resolve(
        cls,
        prefill_base_url: URLArg = None,
        decode_base_url: URLArg = None,
        *,
        on_trace: TraceCallback | None = None,
        on_prefill_failure: str = "decode",
        routing: str | RoutingPolicy | None = None,
        breaker: BreakerSettings | None = None,
        retries: RetrySettings | None = None,
        reuse_secret: str | None = None,
    ) -> PDSettings:
        if on_trace is not None and not callable(on_trace):
            raise PDConfigError(f"on_trace must be callable, got {type(on_trace).__name__}")
        policy = _check_failure_policy(on_prefill_failure, "on_prefill_failure")
        breaker = breaker or BreakerSettings()
        retries = retries or RetrySettings()
        if retries.prefill_attempts < 1 or retries.decode_attempts < 1:
            raise PDConfigError(f"retries: attempts must be at least 1, got {retries}")
        prefill_urls = resolve_urls(prefill_base_url, argument="prefill_base_url", env=PREFILL_ENV)
        decode_urls = resolve_urls(decode_base_url, argument="decode_base_url", env=DECODE_ENV)
        return cls(
            # Each pool gets its own policy object: policies may keep state (round robin's turn).
            prefill=EndpointPool("prefill", prefill_urls, make_policy(routing), breaker),
            decode=EndpointPool("decode", decode_urls, make_policy(routing), breaker),
            on_trace=on_trace,
            on_prefill_failure=policy,
            retry=retries,
            routing=routing,
            reuse_secret=reuse_secret or os.environ.get(SECRET_ENV) or None,
        )


def _json_error(status: int, message: str, leg: str, trace: PDTrace) -> httpx.Response:
    """A response the openai SDK turns into its usual APIStatusError, naming the cause.

    The message says what was wrong; the leg that failed is in the x-pd-failed-leg header.
    """
    body = {"error": {"message": f"pdclient: {message}", "type": "pdclient_error", "code": status}}
    headers = {**trace.to_headers(), _FAILED_LEG_HEADER: leg, "content-type": "application/json"}
    return httpx.Response(status, headers=headers, content=orjson.dumps(body))


def _timeout_within(extensions: dict[str, Any], deadline: float | None) -> dict[str, Any]:
    """Request extensions whose timeouts end no later than the call's deadline."""
    if deadline is None:
        return extensions
    remaining = max(0.001, deadline - time.monotonic())
    timeouts = extensions.get("timeout") or {}
    clipped = {k: remaining if v is None else min(v, remaining) for k, v in timeouts.items()}
    return {**extensions, "timeout": clipped}


class _Handoff:
    """One call's planning and bookkeeping; the transports only move bytes."""

    def __init__(self, settings: PDSettings, request: httpx.Request) -> None:
        self.settings = settings
        self.request = request
        self.request_id = request.headers.get("x-request-id") or f"pd-{uuid.uuid4().hex}"
        self.started = time.perf_counter()
        # openai's `timeout` bounds each read; the prefill phase (with retries) gets it, or
        # the shorter prefill_timeout, as a total.
        bounds = [(request.extensions.get("timeout") or {}).get("read"), settings.retry.prefill_timeout]
        given = [b for b in bounds if b is not None]
        self.deadline = time.monotonic() + min(given) if given else None
        self.kind: Kind | None = None
        self.relative_path = ""
        self.body: dict[str, Any] = {}
        self.on_prefill_failure = settings.on_prefill_failure
        self.affinity: str | None = None
        self.no_ids_reason: str | None = None
        """Why the decode must render the prompt itself (media, echo), decided once per call."""
        self.prefill_endpoint: Endpoint | None = None
        self.prefill_tried: list[Endpoint] = []
        self.prefill_ms: float | None = None
        self.prefill: PrefillResult | None = None
        self.fallback: str | None = None
        self.fallback_url: str | None = None
        self.cpu_seconds = 0.0
        self.decode_endpoint: Endpoint | None = None
        self.decode_tried: list[Endpoint] = []
        self.decode_sent_at = 0.0
        self.decode_headers_ms: float | None = None
        self._decode_status: int | None = None

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
            return self._client_error(f"request body is not JSON: {exc}")
        if not isinstance(body, dict):
            return self._client_error("request body is not a JSON object")
        try:
            options = plan.take_call_options(body)
            if "on_prefill_failure" in options:
                source = f"{plan.CALL_OPTIONS_KEY}.on_prefill_failure"
                self.on_prefill_failure = _check_failure_policy(options["on_prefill_failure"], source)
        except (ValueError, PDConfigError) as exc:
            return self._client_error(str(exc))
        self.body = body
        reason = plan.handoff_refusal(self.kind, body)
        if reason is not None:
            return self._client_error(reason)
        self.affinity = plan.affinity_key(self.kind, body, options.get("session"))
        self.no_ids_reason = plan.ids_not_forwarded_because(self.kind, body)
        return None

    def _client_error(self, message: str) -> httpx.Response:
        self.fallback = f"refused: {message}"
        return self._ended_early(_json_error(400, message, "client", self.trace()))

    def _ended_early(self, response: httpx.Response) -> httpx.Response:
        """The call ends without a decode leg: the caller still gets its trace."""
        deliver(self.trace(), self.settings.on_trace)
        return response

    def prefill_retrying(self) -> dict[str, object]:
        return retry.prefill_policy(self.settings.retry, self.deadline or float("inf"))

    def prefill_request(self) -> httpx.Request:
        """The next prefill attempt's request, on an endpoint this call has not tried yet if any."""
        assert self.kind is not None
        endpoint = self.settings.prefill.pick(self.affinity, avoid=self.prefill_tried)
        endpoint.acquire()
        self.prefill_endpoint = endpoint
        self.prefill_tried.append(endpoint)
        body = plan.plan_prefill(self.kind, self.body)
        request = self._leg_request(endpoint.url, orjson.dumps(body), sign=True)
        request.headers["accept"] = "application/json"
        return request

    def prefill_attempt_failed(self, error: BaseException) -> None:
        """A prefill attempt raised: a transport error counts against the server, a cancel does not."""
        assert self.prefill_endpoint is not None
        self.prefill_endpoint.release(ok=False if isinstance(error, httpx.TransportError) else None)

    def check_prefill(self, response: httpx.Response) -> httpx.Response | None:
        """Judge one prefill attempt: raise to retry, return a response to end the call, or None."""
        assert self.prefill_endpoint is not None and self.kind is not None
        self.prefill_endpoint.release(ok=retry.counts_against_server(response.status_code))
        if retry.is_transient_status(response.status_code):
            raise retry.RetryableStatus(response)
        if response.status_code >= 400:
            # The request itself is wrong (bad model, messages, ...): the decode leg would
            # refuse it too, so the caller gets the prefill's own error.
            self.prefill_ms = self._elapsed_ms()
            return self._pass_error(response, "prefill")
        self.prefill_ms = self._elapsed_ms()
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

    def prefill_failed(self, error: BaseException) -> httpx.Response | None:
        """The prefill leg failed for good: apply the failure policy."""
        self.prefill_ms = self._elapsed_ms()
        if isinstance(error, retry.RetryableStatus):
            reason = f"HTTP {error.response.status_code}: {error.response.text[:200]}"
        else:
            reason = f"{type(error).__name__}: {error}"
        attempts = len(self.prefill_tried)
        reason = f"{reason} (after {attempts} attempt{'s' * (attempts != 1)})"
        self.prefill = None
        if self.on_prefill_failure == "fail":
            self.fallback = f"prefill failed: {reason}"
            if isinstance(error, retry.RetryableStatus):
                return self._pass_error(error.response, "prefill")
            status = 503 if isinstance(error, AllEndpointsOpen) else 502
            return self._ended_early(_json_error(status, f"prefill leg failed: {reason}", "prefill", self.trace()))
        if self.on_prefill_failure == "decode":
            self.fallback = f"prefill failed, decode-only: {reason}"
        else:
            self.fallback_url = self.on_prefill_failure
            self.fallback = f"prefill failed, sent to {self.fallback_url}: {reason}"
        return None

    def decode_request(self) -> httpx.Request:
        """The next decode attempt's request; raises AllEndpointsOpen when none is admitted."""
        if self.fallback_url is not None:
            return self._leg_request(self.fallback_url, self.request.content)
        endpoint = self.settings.decode.pick(self.affinity, avoid=self.decode_tried)
        endpoint.acquire()
        self.decode_endpoint = endpoint
        self.decode_tried.append(endpoint)
        if self.kind is None:
            return self._leg_request(endpoint.url, self.request.content)
        cpu_start = time.thread_time()
        request = self._leg_request(endpoint.url, orjson.dumps(self._decode_body()), sign=True)
        self.cpu_seconds += time.thread_time() - cpu_start
        return request

    def _decode_body(self) -> dict[str, Any]:
        assert self.kind is not None
        if self.no_ids_reason is not None and self.prefill is not None and self.fallback is None:
            self.fallback = f"ids not forwarded: {self.no_ids_reason}"
        return plan.plan_decode(self.kind, self.body, self.prefill, forward_ids=self.no_ids_reason is None)

    def decode_open_failed(self, error: BaseException) -> None:
        """Opening the decode leg raised: a transport error counts against the server."""
        if self.decode_endpoint is not None:
            self.decode_endpoint.release(ok=False if isinstance(error, httpx.TransportError) else None)

    def abandoned(self, error: BaseException) -> None:
        """The call ends with an exception before any decode response: report it."""
        self.fallback = self.fallback or f"decode leg not opened: {type(error).__name__}: {error}"
        if self.kind is not None:
            deliver(self.trace(), self.settings.on_trace)

    def release_request(self) -> httpx.Request | None:
        """A one-token decode that frees the prefill's KV blocks, if the call was abandoned."""
        if self.kind is None or not plan.holds_remote_kv(self.prefill) or self.fallback_url is not None:
            return None
        assert self.prefill is not None
        body = plan.plan_release(self.kind, self.body, self.prefill, forward_ids=self.no_ids_reason is None)
        try:
            endpoint = self.settings.decode.pick(self.affinity)
        except AllEndpointsOpen:
            return None  # the blocks expire with the connector's timeout
        return self._leg_request(endpoint.url, orjson.dumps(body), sign=True)

    def _leg_request(self, base: str, content: bytes, *, sign: bool = False) -> httpx.Request:
        """A leg's request; ``sign``: a handoff leg, signed over its final bytes when there is a secret."""
        headers = self.request.headers.copy()
        for name in _DROPPED_REQUEST_HEADERS:
            headers.pop(name, None)
        headers["x-request-id"] = self.request_id
        query = self.request.url.query
        url = httpx.URL(base + self.relative_path, query=query or None) if self.relative_path else None
        request = httpx.Request(
            self.request.method,
            url or self.request.url,
            headers=headers,
            content=content,
            extensions=_timeout_within(self.request.extensions, self.deadline if self.prefill_ms is None else None),
        )
        secret = self.settings.reuse_secret
        if sign and secret:
            # A fresh nonce per attempt; the body is covered byte for byte (no re-encode).
            request.headers[SIGNATURE_HEADER] = signature(secret, request.method, request.url.path, content)
        return request

    def _elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000

    # -- results -------------------------------------------------------------------

    def forwarded_tokens(self) -> int:
        if self.prefill is None or self.prefill.prompt_token_ids is None or self.no_ids_reason is not None:
            return 0
        return len(self.prefill.prompt_token_ids)

    def trace(self, decode_first_byte_ms: float | None = None) -> PDTrace:
        decode_url = self.fallback_url or (self.decode_endpoint.url if self.decode_endpoint else None)
        return PDTrace(
            request_id=self.request_id,
            route=self.kind.value if self.kind else "passthrough",
            prefill_url=self.prefill_endpoint.url if self.prefill_endpoint else None,
            decode_url=decode_url,
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
        return self._ended_early(httpx.Response(response.status_code, headers=headers, content=response.content))

    def decode_unavailable(self, error: AllEndpointsOpen) -> httpx.Response:
        self.fallback = str(error)
        return self._ended_early(_json_error(503, str(error), "decode", self.trace()))

    def decode_response(
        self, response: httpx.Response, stream: httpx.SyncByteStream | httpx.AsyncByteStream
    ) -> httpx.Response:
        self.decode_headers_ms = (time.perf_counter() - self.decode_sent_at) * 1000
        self._decode_status = response.status_code
        headers = httpx.Headers(response.headers)
        headers.update(self.trace().to_headers())
        if response.status_code >= 400:
            headers[_FAILED_LEG_HEADER] = "decode"
        return httpx.Response(response.status_code, headers=headers, stream=stream, extensions=response.extensions)

    def broken_stream(self, error: httpx.TransportError, received: int) -> openai.APIConnectionError:
        """A decode stream cut mid-way, as the openai error a caller already handles.

        openai 3.x maps an httpx error during iteration to APIConnectionError itself, 2.x
        lets the raw httpx error through; raising the openai error here makes both alike.
        """
        url = self.decode_endpoint.url if self.decode_endpoint else self.fallback_url
        self.fallback = f"decode stream broke after {received} bytes: {type(error).__name__}: {error}"
        message = f"pdclient: {self.fallback} (decode {url}, request {self.request_id})"
        return openai.APIConnectionError(message=message, request=self.request)  # type: ignore[arg-type]

    def finish(self, first_byte_at: float | None) -> None:
        """The decode response was closed (fully read or abandoned)."""
        if self.decode_endpoint is not None:
            self.decode_endpoint.release(ok=retry.counts_against_server(self._decode_status))
        if self.kind is None:
            return  # a pass-through request is not a handoff: nothing to report
        first_byte_ms = None if first_byte_at is None else (first_byte_at - self.decode_sent_at) * 1000
        deliver(self.trace(decode_first_byte_ms=first_byte_ms), self.settings.on_trace)


_SSE_DONE = b"data: [DONE]"
_SSE_TAIL = 32  # [DONE] is the stream's last event: look for it at a chunk's end only


class _TracedStream(httpx.SyncByteStream):
    """The decode body, passed through chunk by chunk; bookkeeping is done on close."""

    def __init__(self, response: httpx.Response, handoff: _Handoff) -> None:
        self._response = response
        self._handoff = handoff
        self._first_byte_at: float | None = None
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        received = 0
        try:
            chunks = iter(self._response.stream)  # type: ignore[arg-type]
            for chunk in chunks:
                if self._first_byte_at is None:
                    self._first_byte_at = time.perf_counter()
                if _SSE_DONE in chunk[-_SSE_TAIL:]:
                    # openai stops reading at [DONE] and closes; the body's end is right behind
                    # it, so read it now and the connection goes back to the pool for reuse.
                    chunk += b"".join(chunks)
                received += len(chunk)
                yield chunk
        except httpx.TransportError as exc:
            raise self._handoff.broken_stream(exc, received) from exc

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
        received = 0
        try:
            chunks = aiter(self._response.stream)  # type: ignore[arg-type]
            async for chunk in chunks:
                if self._first_byte_at is None:
                    self._first_byte_at = time.perf_counter()
                if _SSE_DONE in chunk[-_SSE_TAIL:]:
                    chunk += b"".join([rest async for rest in chunks])
                received += len(chunk)
                yield chunk
        except httpx.TransportError as exc:
            raise self._handoff.broken_stream(exc, received) from exc

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

    Keyword arguments are those of ``PDChatClient``; ``leg_transport`` sends both legs
    (default: a pooled ``httpx.HTTPTransport``).
    """

    def __init__(
        self,
        prefill_base_url: URLArg = None,
        decode_base_url: URLArg = None,
        *,
        leg_transport: httpx.BaseTransport | None = None,
        settings: PDSettings | None = None,
        **options: Any,
    ) -> None:
        self.settings = settings or PDSettings.resolve(prefill_base_url, decode_base_url, **options)
        self._legs = leg_transport or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        handoff = _Handoff(self.settings, request)
        if handoff.kind is not None:
            request.read()
            ended = handoff.refusal() or self._run_prefill(handoff)
            if ended is not None:
                return ended
        try:
            response = self._open_decode(handoff)
        except AllEndpointsOpen as exc:
            self._release_kv(handoff)
            return handoff.decode_unavailable(exc)
        except BaseException as exc:
            self._release_kv(handoff)
            handoff.abandoned(exc)
            raise
        return handoff.decode_response(response, _TracedStream(response, handoff))

    def _run_prefill(self, handoff: _Handoff) -> httpx.Response | None:
        try:
            for attempt in tenacity.Retrying(**handoff.prefill_retrying()):  # type: ignore[arg-type]
                with attempt:
                    request = handoff.prefill_request()
                    try:
                        response = self._legs.handle_request(request)
                        try:
                            response.read()
                        finally:
                            response.close()
                    except BaseException as exc:
                        handoff.prefill_attempt_failed(exc)
                        raise
                    return handoff.check_prefill(response)
        except (httpx.TransportError, retry.RetryableStatus, AllEndpointsOpen) as exc:
            return handoff.prefill_failed(exc)
        return None

    def _open_decode(self, handoff: _Handoff) -> httpx.Response:
        for attempt in tenacity.Retrying(**retry.decode_policy(handoff.settings.retry)):  # type: ignore[arg-type]
            with attempt:
                request = handoff.decode_request()
                handoff.decode_sent_at = time.perf_counter()
                try:
                    return self._legs.handle_request(request)
                except BaseException as exc:
                    handoff.decode_open_failed(exc)
                    raise
        raise AssertionError("unreachable: tenacity reraises the last error")

    def _release_kv(self, handoff: _Handoff) -> None:
        """The call ended between the legs: free the prefill's KV blocks in the background."""
        request = handoff.release_request()
        if request is None:
            return

        def send() -> None:
            try:
                self._legs.handle_request(request).close()
            except Exception as exc:
                logger.debug("KV release for %s failed: %s", handoff.request_id, exc)

        threading.Thread(target=send, name=f"pdclient-release-{handoff.request_id}", daemon=True).start()

    def close(self) -> None:
        self._legs.close()


class AsyncPDTransport(httpx.AsyncBaseTransport):
    """Async twin of ``PDTransport``."""

    def __init__(
        self,
        prefill_base_url: URLArg = None,
        decode_base_url: URLArg = None,
        *,
        leg_transport: httpx.AsyncBaseTransport | None = None,
        settings: PDSettings | None = None,
        **options: Any,
    ) -> None:
        self.settings = settings or PDSettings.resolve(prefill_base_url, decode_base_url, **options)
        self._legs = leg_transport or httpx.AsyncHTTPTransport()
        self._releases: set[asyncio.Task[None]] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        handoff = _Handoff(self.settings, request)
        if handoff.kind is not None:
            await request.aread()
            ended = handoff.refusal() or await self._run_prefill(handoff)
            if ended is not None:
                return ended
        try:
            response = await self._open_decode(handoff)
        except AllEndpointsOpen as exc:
            self._release_kv(handoff)
            return handoff.decode_unavailable(exc)
        except BaseException as exc:
            self._release_kv(handoff)
            handoff.abandoned(exc)
            raise
        return handoff.decode_response(response, _AsyncTracedStream(response, handoff))

    async def _run_prefill(self, handoff: _Handoff) -> httpx.Response | None:
        try:
            async for attempt in tenacity.AsyncRetrying(**handoff.prefill_retrying()):  # type: ignore[arg-type]
                with attempt:
                    request = handoff.prefill_request()
                    try:
                        response = await self._legs.handle_async_request(request)
                        try:
                            await response.aread()
                        finally:
                            await response.aclose()
                    except BaseException as exc:
                        handoff.prefill_attempt_failed(exc)
                        raise
                    return handoff.check_prefill(response)
        except (httpx.TransportError, retry.RetryableStatus, AllEndpointsOpen) as exc:
            return handoff.prefill_failed(exc)
        return None

    async def _open_decode(self, handoff: _Handoff) -> httpx.Response:
        async for attempt in tenacity.AsyncRetrying(**retry.decode_policy(handoff.settings.retry)):  # type: ignore[arg-type]
            with attempt:
                request = handoff.decode_request()
                handoff.decode_sent_at = time.perf_counter()
                try:
                    return await self._legs.handle_async_request(request)
                except BaseException as exc:
                    handoff.decode_open_failed(exc)
                    raise
        raise AssertionError("unreachable: tenacity reraises the last error")

    def _release_kv(self, handoff: _Handoff) -> None:
        """The call ended between the legs: free the prefill's KV blocks in the background."""
        request = handoff.release_request()
        if request is None:
            return

        async def send() -> None:
            try:
                response = await self._legs.handle_async_request(request)
                await response.aclose()
            except Exception as exc:
                logger.debug("KV release for %s failed: %s", handoff.request_id, exc)

        # Held in a set: the event loop keeps only weak references to tasks.
        task = asyncio.get_running_loop().create_task(send())
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)

    async def aclose(self) -> None:
        await self._legs.aclose()


__all__: Sequence[str] = ("PDTransport", "AsyncPDTransport", "PDSettings")
