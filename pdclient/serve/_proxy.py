"""The proxy as an ASGI app (Starlette), built on the async P/D transport.

Every ``/v1`` request becomes one ``httpx.Request`` for the transport: chat and
completions take the handoff, everything else goes to a decode endpoint unchanged. The
transport's response is passed back as it arrives, one ASGI body message per chunk of
its stream, while a second task listens for the caller's disconnect: when the caller
goes away, the work in progress is cancelled (before the decode answers, that is the
transport's cancel-safe path, which frees the prefill's KV) and the upstream response is
closed, which closes its connection.

What a caller can reach and learn: only paths under ``/v1`` (read as the servers' router
reads them: percent-decoded once, ``.`` and ``..`` resolved, repeated slashes merged),
never the servers' other routes; an error says which leg failed and how, not which server
(unless ``trace_headers``); its state on the servers (conversations, cached prefixes) is
its tenant's, never another's (``RouteRequest.tenant``).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote_from_bytes

import anyio
import httpx
import openai
import orjson
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from .. import AsyncPDTransport, CallView, LegView, PDObserver
from ..handoff import (  # the per-call costs, cut once (see each)
    PrefillRedirected,
    leg_url,
    new_correlation_id,
    request_with_content,
)
from ..metrics import BuildInfo, PrometheusObserver, WithoutCreated
from ..pools import AllEndpointsOpen
from ..routing import TENANT_EXTENSION
from ..transport import AsyncDecodeStream
from ..wire import (
    ERROR_TYPE,
    FAILED_LEG_HEADER,
    HOP_BY_HOP,
    RAW_TRACE_HEADER_PREFIX,
    TRACE_HEADERS_EXTENSION,
    ends_event_stream,
    error_body,
    redact_url,
)
from ._config import MULTIPROC_ENV, ServeConfig
from ._legs import AiohttpTransport
from ._logging import CallLog
from ._paths import API_PREFIX, base_paths, own_location, upstream_path
from ._readiness import readiness
from ._telemetry import Tracing, tracing

logger = logging.getLogger("pdclient.serve")


# Not copied from the caller to the servers: hop-by-hop, recomputed, or the caller's key.
_DROPPED_REQUEST_HEADERS = HOP_BY_HOP | {b"host", b"content-length", b"authorization", b"x-request-id"}
# Not copied from the servers to the caller: hop-by-hop, or set by our own HTTP server.
_DROPPED_RESPONSE_HEADERS = HOP_BY_HOP | {b"server", b"date"}
PROXIED_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
_FAILED_LEG_HEADER = FAILED_LEG_HEADER.encode("ascii")
LEG_ERRORS = "pdclient.serve.leg_errors"
"""The upstream request's extension where ``LegErrors`` keeps each leg's last failure."""


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error body, as the openai SDKs read it."""
    body = {"error": error_body(f"pdclient serve: {message}", status)}
    return JSONResponse(body, status_code=status, headers=headers)


class _BodyTooLarge(Exception):
    pass


class _CallerLeft(Exception):
    """The caller disconnected before its request body was in."""


class _NoTenant(Exception):
    """The tenant header the operator named is missing."""


def _is_own_error(response: httpx.Response) -> bool:
    """Whether ``response`` is pdclient's error for a failed leg, not a server's answer: its
    message holds the failure's text, which may name the server."""
    if response.status_code < 500 or response.headers.get(FAILED_LEG_HEADER) not in ("prefill", "decode"):
        return False
    if not isinstance(response.stream, httpx.ByteStream):  # a server's answer, streamed: passed on as it comes
        return False
    try:
        error = orjson.loads(response.content).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("type") == ERROR_TYPE


_TENANT_DOMAIN = b"pdclient serve tenant v1\x00"


def tenant_digest(value: bytes) -> str:
    """The tenant a caller's credentials (or tenant header) stand for: the same in every
    worker and every replica, so state kept per tenant (conversations, cached prefixes) is
    found wherever the caller's next request lands. A plain SHA-256, in a domain of its own
    (no other digest of the same bytes matches it): an API key has too much entropy to be
    found again from its digest, and the digest is never shown."""
    return hashlib.sha256(_TENANT_DOMAIN + value).hexdigest()[:32]


class LegErrors(PDObserver):
    """Keeps each leg's last failure on the proxy's upstream request (``LEG_ERRORS``), so the
    caller's error body can say how a leg failed without the failure's own text, which
    names the server."""

    def on_leg_end(self, call: CallView, leg: LegView, status: int | None, error: BaseException | None) -> None:
        if error is not None:
            errors = call.request.extensions.get(LEG_ERRORS)
            if errors is not None:
                errors[leg.name] = error


def failure_kind(error: BaseException | None) -> str:
    """How a leg failed, in words that name no server."""
    if isinstance(error, AllEndpointsOpen):
        return "no admitted endpoint (every circuit breaker is open)"
    if isinstance(error, httpx.ConnectTimeout):
        return "connect timeout"
    if isinstance(error, httpx.ConnectError):
        return "connect error"
    if isinstance(error, httpx.TimeoutException):
        return "timeout"
    if isinstance(error, httpx.RemoteProtocolError):
        return "the server closed the connection or broke the protocol"
    if isinstance(error, httpx.TransportError):
        return "network error"
    if isinstance(error, PrefillRedirected):
        return "the server answered a redirect, not a prefill"
    return "error" if error is None else type(error).__name__


class Proxy:
    """The app's state and handlers: one transport, its observers, the caller keys."""

    def __init__(
        self,
        config: ServeConfig,
        *,
        leg_transport: httpx.AsyncBaseTransport | None = None,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.config = config
        self.multiprocess = bool(os.environ.get(MULTIPROC_ENV)) and registry is None
        # The observer's metrics live in their own registry; under multiprocess mode a scrape
        # reads every worker's files instead (MultiProcessCollector), plus this worker's endpoints.
        self.metrics = PrometheusObserver(CollectorRegistry() if registry is None else registry)
        if self.multiprocess:
            from prometheus_client import multiprocess

            self.scrape_registry = CollectorRegistry()
            multiprocess.MultiProcessCollector(self.scrape_registry)  # type: ignore[no-untyped-call]
            self.scrape_registry.register(BuildInfo())  # the workers' files hold only what they counted
        else:
            self.scrape_registry = self.metrics.registry
        # aiohttp sends the legs: a third of httpx's CPU per request (pdclient/serve/_legs.py).
        legs = leg_transport or AiohttpTransport(max_connections=config.max_connections)
        options = config.options
        self.tracing: Tracing | None = tracing(config.otel, os.environ)
        traced = () if self.tracing is None else (self.tracing.observer,)
        observers: tuple[PDObserver, ...] = (self.metrics, CallLog(), LegErrors(), *traced, *options.observers)
        # A caller must not choose where the proxy sends requests (no per-call fallback URL),
        # nor loosen the operator's settings unless the operator allows it.
        options = options.replace(
            observers=observers, allow_call_fallback_url=False, allow_call_overrides=config.allow_call_overrides
        )
        self.transport = AsyncPDTransport(options=options, leg_transport=legs)
        self.transport.fleet.send_background_with(legs)  # warm-ups, probes and scrapes on aiohttp too
        self.metrics.watch(self.transport, registry=self.scrape_registry)
        self.api_base = options.decode_urls[0]
        self._base_paths = base_paths((*options.decode_urls, *options.prefill_urls))
        self._keys = [key.encode() for key in config.api_keys]
        t = config.timeout
        self._timeouts = {"connect": config.connect_timeout, "read": t, "write": t, "pool": t}
        self.draining = False
        """Set by the shutdown signal (``drain``): ``/ready`` answers 503 from then on."""
        self._tenant_header = config.tenant_header.lower().encode("ascii") if config.tenant_header else None
        self._digest = functools.lru_cache(maxsize=4096)(tenant_digest)

    def drain(self) -> None:
        """The server is shutting down: no more readiness (calls in flight go on)."""
        self.draining = True

    # -- routes ----------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """200 when this proxy can answer a chat call now (see ``readiness``), else 503; 503
        too from the shutdown signal on. With ``status_requires_api_key``, a request without
        a key gets the verdict alone, not the endpoints: a kubelet's probe or a load
        balancer's health check sends no key and needs only the status code, while the
        endpoint list tells anyone who asks where the servers are."""
        body = readiness(self.transport, self.config.ready_requires_prefill)
        if self.draining:
            body.update(ready=False, draining=True)
        if self.config.status_requires_api_key and not self._authorized(request.scope["headers"]):
            body = {name: value for name, value in body.items() if name in _READY_VERDICT}
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        if self.config.status_requires_api_key and not self._authorized(request.scope["headers"]):
            return _unauthorized()
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(WithoutCreated(self.scrape_registry)), media_type=content_type)

    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A ``/v1`` request, at the ASGI level: the caller's raw headers go on as bytes, and no
        router or middleware runs per call (Starlette's stack was ~4 % of the proxy's CPU)."""
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if self._keys and not self._authorized(headers):
            await _unauthorized()(scope, receive, send)
            return
        # raw_path is optional in ASGI: without it, the decoded path is encoded again to be read once.
        raw_path = scope.get("raw_path") or quote_from_bytes(scope["path"].encode("utf-8"), safe="/").encode()
        path = upstream_path(raw_path)
        if path is None:
            message = f"no such route: only paths under {API_PREFIX}/ are proxied (read decoded, '..' resolved)"
            await error_response(404, message)(scope, receive, send)
            return
        try:
            tenant = self._tenant(headers)
        except _NoTenant:
            message = f"the {self.config.tenant_header} header (the caller's tenant) is missing"
            await error_response(400, message)(scope, receive, send)
            return
        try:  # within body_timeout: the connection's deadline (_protocol), or the caller is gone
            body = await self._read_body(headers, receive)
        except _BodyTooLarge:
            limit = self.config.max_body_size
            message = f"request body is larger than this proxy's limit of {limit} bytes"
            await error_response(413, message)(scope, receive, send)
            return
        except ValueError as exc:
            await error_response(400, str(exc))(scope, receive, send)
            return
        except _CallerLeft:
            return
        # The caller's id, or a random one, is a correlation id (logs, the answer's header): the
        # legs carry one of the transport's own (``handoff.new_leg_id``) no caller can choose.
        given_id = _header(headers, b"x-request-id")
        request_id = given_id.decode("latin-1") if given_id else new_correlation_id()
        extensions: dict[str, Any] = {"timeout": self._timeouts, LEG_ERRORS: {}}
        if not self.config.trace_headers:
            extensions[TRACE_HEADERS_EXTENSION] = False  # response_headers would drop them
        if tenant is not None:
            extensions[TENANT_EXTENSION] = tenant
        upstream = request_with_content(
            scope["method"],
            leg_url(self.api_base, path[len(API_PREFIX) :], scope["query_string"]),
            self._upstream_headers(headers, request_id),
            body,
            extensions,
        )
        await _ProxiedResponse(self, upstream, request_id)(scope, receive, send)

    # -- helpers ---------------------------------------------------------------------

    def _tenant(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        """The caller's tenant: a digest of the operator's tenant header (``_NoTenant`` when
        it is missing), else of the credentials the caller sent (None: it sent none, and
        shares the state of every other caller that sends none)."""
        if self._tenant_header is not None:
            value = _header(headers, self._tenant_header)
            if not value:
                raise _NoTenant
            return self._digest(b"header:" + value)
        credentials = (_header(headers, b"authorization") or b"").strip()
        return self._digest(b"authorization:" + credentials) if credentials else None

    def _authorized(self, headers: list[tuple[bytes, bytes]]) -> bool:
        scheme, _, token = (_header(headers, b"authorization") or b"").partition(b" ")
        given = token.strip() if scheme.lower() == b"bearer" else b""
        # Every key is compared (no early exit), each in constant time.
        return sum(hmac.compare_digest(given, key) for key in self._keys) > 0

    async def _read_body(self, headers: list[tuple[bytes, bytes]], receive: Receive) -> bytes:
        limit = self.config.max_body_size
        declared = _header(headers, b"content-length")
        if declared is not None:
            if not declared.isdigit():
                raise ValueError(f"invalid content-length {declared.decode('latin-1')!r}")
            if int(declared) > limit:
                raise _BodyTooLarge
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _CallerLeft
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)

    def _upstream_headers(self, headers: list[tuple[bytes, bytes]], request_id: str) -> list[tuple[bytes, bytes]]:
        upstream = [(k, v) for k, v in headers if k not in _DROPPED_REQUEST_HEADERS]
        given_key = _header(headers, b"authorization")
        if self.config.forward_api_key and given_key is not None:
            upstream.append((b"authorization", given_key))
        elif self.config.upstream_api_key:
            upstream.append((b"authorization", f"Bearer {self.config.upstream_api_key}".encode("latin-1")))
        upstream.append((b"x-request-id", request_id.encode("latin-1")))
        return upstream

    def response_headers(self, upstream: httpx.Response, request_id: str) -> list[tuple[bytes, bytes]]:
        headers = []
        for raw_name, value in upstream.headers.raw:
            name = raw_name.lower()
            if name in _DROPPED_RESPONSE_HEADERS or name == b"x-request-id":
                continue
            if name == b"location":  # it names the server that sent it
                own = own_location(value, self._base_paths)
                if own is None:
                    continue
                value = own
            if (
                name.startswith(RAW_TRACE_HEADER_PREFIX)
                and name != _FAILED_LEG_HEADER
                and not self.config.trace_headers
            ):
                continue
            headers.append((name, value))
        headers.append((b"x-request-id", request_id.encode("latin-1")))
        return headers


_READY_VERDICT = ("ready", "degraded", "draining")
"""What ``/ready`` tells a request without a key when the status routes require one."""


def _unauthorized() -> JSONResponse:
    return error_response(401, "missing or invalid API key", {"www-authenticate": "Bearer"})


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """An ASGI request header's value (names are lower-case there), the first if repeated."""
    return next((value for key, value in headers if key == name), None)


async def _unless_disconnected(receive: Receive, work: Callable[[], Awaitable[None]]) -> None:
    """Run ``work`` until it ends or the caller disconnects (then it is cancelled).

    Only called once the request body has been read: the next ASGI message can only be
    the disconnect. One watcher per call, for the legs and the streaming alike: a bare
    asyncio task that cancels an anyio scope, so the work's shielded parts (the KV
    release, closing the decode) stay shielded. An anyio task group per call cost ~50 us
    of CPU, a tenth of the proxy's own per call (benchmarks/bench_serve_cpu.py).
    """
    with anyio.CancelScope() as scope:

        async def watch() -> None:
            try:
                while (await receive())["type"] != "http.disconnect":
                    pass
            except Exception:  # the connection is gone some other way: so is the caller
                pass
            scope.cancel()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await work()
        finally:
            watcher.cancel()


class _ProxiedResponse(Response):
    """Sends the upstream request, then streams its response back chunk by chunk; a caller
    who leaves cancels either (before the decode answers, that is the transport's
    cancel-safe path)."""

    def __init__(self, proxy: Proxy, upstream: httpx.Request, request_id: str) -> None:
        self._proxy = proxy
        self._upstream = upstream
        self._request_id = request_id

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await _unless_disconnected(receive, lambda: self._answer(scope, receive, send))

    async def _answer(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response = await self._proxy.transport.handle_async_request(self._upstream)
        except httpx.TransportError as exc:  # only the decode leg raises: the prefill's are answers
            # Logged by the call's own line (CallLog), its error included: one line per call.
            status = 504 if isinstance(exc, httpx.TimeoutException) else 502
            detail = f"{type(exc).__name__}: {exc}"
            await self._fail(scope, receive, send, status, "decode", failure_kind(exc), detail)
            return
        try:
            if not self._proxy.config.trace_headers and _is_own_error(response):
                await self._fail(scope, receive, send, response.status_code, *self._own_error(response))
                return
            await self._stream(response, send)
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()

    def _own_error(self, response: httpx.Response) -> tuple[str, str]:
        """The failed leg of an ``_is_own_error`` response, and how it failed."""
        leg = response.headers[FAILED_LEG_HEADER]
        if response.status_code == 503:  # pdclient's answer when no endpoint is admitted
            kind = failure_kind(AllEndpointsOpen())
        else:
            kind = failure_kind(self._upstream.extensions[LEG_ERRORS].get(leg))
        attempts = response.headers.get(f"x-pd-{leg}-attempts", "")
        if attempts.isdigit() and int(attempts) > 1:
            kind += f", after {attempts} attempts"
        return leg, kind

    async def _stream(self, response: httpx.Response, send: Send) -> None:
        headers = self._proxy.response_headers(response, self._request_id)
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        length = response.headers.get("content-length")
        expected = int(length) if length is not None and length.isdigit() else None
        received = 0
        last = b""

        def deliver(chunk: bytes) -> Awaitable[None] | None:
            nonlocal received, last
            received += len(chunk)
            if (expected is not None and received >= expected) or ends_event_stream(chunk):
                last += chunk  # the body's end: sent once the upstream stream is over, below
                return None
            return send({"type": "http.response.body", "body": chunk, "more_body": True})

        stream = response.stream
        # A decode body is relayed: its chunks reach the caller from the leg's reader (``transport._relay``).
        chunks = stream.relayed(deliver) if isinstance(stream, AsyncDecodeStream) else stream
        try:
            async for chunk in chunks:  # type: ignore[union-attr]
                if (sending := deliver(chunk)) is not None:
                    await sending
        except (httpx.TransportError, openai.APIConnectionError):
            return  # the decode stream broke: the caller sees it cut off too, the call's line says why
        except Exception:  # not a broken stream: a fault of the proxy's own, cut off all the same
            logger.exception("request %s: the answer's stream failed", self._request_id)
            return
        # Closed before the caller can see the end, so the call is recorded (metrics, log) by
        # then: a caller that reads a body's last byte, or an SSE stream's [DONE], and then
        # asks /metrics finds its call there.
        await response.aclose()
        await send({"type": "http.response.body", "body": last, "more_body": False})

    async def _fail(
        self, scope: Scope, receive: Receive, send: Send, status: int, leg: str, kind: str, detail: str | None = None
    ) -> None:
        """An error body that says which leg failed and how; the failure's own text (which
        names the server) only with ``trace_headers``."""
        message = f"{leg} leg failed: {kind}"
        if detail and self._proxy.config.trace_headers:
            message += f" ({redact_url(detail)})"
        headers = {"x-request-id": self._request_id, _FAILED_LEG_HEADER.decode(): leg}
        await error_response(status, message, headers)(scope, receive, send)
