"""The proxy as an ASGI app (Starlette), built on the async P/D transport.

Every ``/v1`` request becomes one ``httpx.Request`` for the transport: chat and
completions take the handoff, everything else goes to a decode endpoint unchanged. The
transport's response is passed back as it arrives, one ASGI body message per chunk of
its stream, while a second task listens for the caller's disconnect: when the caller
goes away, the work in progress is cancelled (before the decode answers, that is the
transport's cancel-safe path, which frees the prefill's KV) and the upstream response is
closed, which closes its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .. import AsyncPDTransport, PDObserver
from .._call import leg_url, new_request_id, request_with_content  # the per-call costs, cut once (see each)
from .._streams import ends_event_stream  # where a decode body ends
from ..metrics import PrometheusObserver, endpoint_states
from ._config import CONFIG_ENV, ServeConfig
from ._legs import AiohttpTransport
from ._logging import CallLog
from ._run import MULTIPROC_ENV

logger = logging.getLogger("pdclient.serve")

API_PREFIX = "/v1"

# Not copied from the caller to the servers: hop-by-hop, recomputed, or the caller's key.
_DROPPED_REQUEST_HEADERS = frozenset(
    {b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"te", b"upgrade", b"trailer",
     b"proxy-authorization", b"proxy-connection", b"authorization", b"x-request-id"}
)  # fmt: skip
# Not copied from the servers to the caller: hop-by-hop, or set by our own HTTP server.
_DROPPED_RESPONSE_HEADERS = frozenset(
    {b"transfer-encoding", b"connection", b"keep-alive", b"te", b"upgrade", b"trailer", b"proxy-connection", b"server",
     b"date"}
)  # fmt: skip
_PROXIED_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS")
_TRACE_HEADER_PREFIX = b"x-pd-"
_FAILED_LEG_HEADER = b"x-pd-failed-leg"


def error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An OpenAI-style error body, as the openai SDKs read it."""
    body = {"error": {"message": f"pdclient serve: {message}", "type": "pdclient_error", "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


class _BodyTooLarge(Exception):
    pass


class _CallerLeft(Exception):
    """The caller disconnected before its request body was in."""


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
        else:
            self.scrape_registry = self.metrics.registry
        # aiohttp sends the legs: a third of httpx's CPU per request (pdclient/serve/_legs.py).
        legs = leg_transport or AiohttpTransport(max_connections=config.max_connections)
        options = config.options
        observers: tuple[PDObserver, ...] = (self.metrics, CallLog(), *options.observers)
        # A caller must not choose where the proxy sends requests: no per-call fallback URL.
        options = options.replace(observers=observers, allow_call_fallback_url=False)
        self.transport = AsyncPDTransport(options=options, leg_transport=legs)
        self.metrics.watch(self.transport, registry=self.scrape_registry)
        self.api_base = options.decode_urls[0]
        self._keys = [key.encode() for key in config.api_keys]
        t = config.timeout
        self._timeouts = {"connect": config.connect_timeout, "read": t, "write": t, "pool": t}

    # -- routes ----------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(self, request: Request) -> Response:
        """200 when this proxy can answer a chat call now (see ``readiness``), else 503."""
        body = readiness(self.transport, self.config.ready_requires_prefill)
        return JSONResponse(body, status_code=200 if body["ready"] else 503)

    async def metrics_endpoint(self, request: Request) -> Response:
        encoder, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encoder(self.scrape_registry), media_type=content_type)

    async def proxy(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A ``/v1`` request, at the ASGI level: the caller's raw headers go on as bytes, and no
        router or middleware runs per call (Starlette's stack was ~4 % of the proxy's CPU)."""
        headers: list[tuple[bytes, bytes]] = scope["headers"]
        if self._keys and not self._authorized(headers):
            refusal = error_response(401, "missing or invalid API key", {"www-authenticate": "Bearer"})
            await refusal(scope, receive, send)
            return
        try:
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
        # The path as the caller encoded it (raw_path): "org%2Fmodel" stays one segment.
        raw_path: bytes = scope.get("raw_path") or scope["path"].encode()
        path = raw_path.decode("latin-1")[len(API_PREFIX) :]
        given_id = _header(headers, b"x-request-id")
        request_id = given_id.decode("latin-1") if given_id else new_request_id()
        upstream = request_with_content(
            scope["method"],
            leg_url(self.api_base, path, scope["query_string"]),
            self._upstream_headers(headers, request_id),
            body,
            {"timeout": self._timeouts},
        )
        await _ProxiedResponse(self, upstream, request_id)(scope, receive, send)

    # -- helpers ---------------------------------------------------------------------

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
            if name.startswith(_TRACE_HEADER_PREFIX) and name != _FAILED_LEG_HEADER and not self.config.trace_headers:
                continue
            headers.append((name, value))
        headers.append((b"x-request-id", request_id.encode("latin-1")))
        return headers


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> bytes | None:
    """An ASGI request header's value (names are lower-case there), the first if repeated."""
    return next((value for key, value in headers if key == name), None)


def readiness(transport: AsyncPDTransport, requires_prefill: bool = False) -> dict[str, Any]:
    """``/ready``'s body: each endpoint's breaker, and whether a chat call can be answered now.

    A decode endpoint must be admitted. A prefill endpoint must be too when the failure
    policy is ``fail`` (every call would fail without one) or ``requires_prefill`` is set;
    with ``decode`` (the default) or a fallback URL the proxy still answers every call,
    without the handoff, so it stays ready and says ``degraded``. Taking every replica of
    a proxy out of its load balancer because the shared prefill pool is down would turn a
    slower answer into no answer.
    """
    body: dict[str, Any] = {"ready": False, "degraded": False, "prefill": [], "decode": []}
    for e in endpoint_states(transport):
        body[e.leg].append({"url": e.url, "state": e.state, "admitted": e.admitted, "in_flight": e.in_flight})
    prefill_up, decode_up = (any(e["admitted"] for e in body[leg]) for leg in ("prefill", "decode"))
    policy = transport.options.on_prefill_failure
    if prefill_up:
        body["ready"] = decode_up
    elif requires_prefill or policy == "fail":
        body["ready"] = False
    else:  # decode-only, or the fallback server (outside the pools: its health is not tracked)
        body["ready"] = decode_up or policy != "decode"
        body["degraded"] = body["ready"]
    return body


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
        except httpx.TimeoutException as exc:
            await self._fail(scope, receive, send, 504, f"upstream timed out: {type(exc).__name__}: {exc}")
            return
        except httpx.TransportError as exc:
            await self._fail(scope, receive, send, 502, f"upstream unreachable: {type(exc).__name__}: {exc}")
            return
        try:
            await self._stream(response, send)
        finally:
            with anyio.CancelScope(shield=True):
                await response.aclose()

    async def _stream(self, response: httpx.Response, send: Send) -> None:
        headers = self._proxy.response_headers(response, self._request_id)
        await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
        length = response.headers.get("content-length")
        expected = int(length) if length is not None and length.isdigit() else None
        received = 0
        last = b""
        try:
            async for chunk in response.stream:  # type: ignore[union-attr]
                received += len(chunk)
                if (expected is not None and received >= expected) or ends_event_stream(chunk):
                    last += chunk  # the body's end: sent once the upstream stream is over, below
                    continue
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except Exception as exc:  # the decode stream broke: the caller sees it cut off too
            logger.warning("request %s: upstream stream broke: %s", self._request_id, exc)
            return
        # Closed before the caller can see the end, so the call is recorded (metrics, log) by
        # then: a caller that reads a body's last byte, or an SSE stream's [DONE], and then
        # asks /metrics finds its call there.
        await response.aclose()
        await send({"type": "http.response.body", "body": last, "more_body": False})

    async def _fail(self, scope: Scope, receive: Receive, send: Send, status: int, message: str) -> None:
        logger.warning("request %s: %s", self._request_id, message)
        await error_response(status, message, {"x-request-id": self._request_id})(scope, receive, send)


def create_app(
    config: ServeConfig,
    *,
    leg_transport: httpx.AsyncBaseTransport | None = None,
    registry: CollectorRegistry | None = None,
) -> ProxyApp:
    """The proxy app for ``config``.

    ``leg_transport`` sends the legs (default: ``AiohttpTransport``, pooled);
    ``registry`` receives the metrics (default: one of the app's own). Observers of one's
    own go in ``config.options.observers``, beside the proxy's (metrics, the log line). The
    app's state is ``app.state.proxy`` (a ``Proxy``: its ``transport``, ``metrics``, ``config``).
    """
    proxy = Proxy(config, leg_transport=leg_transport, registry=registry)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await proxy.transport.aclose()
            if proxy.multiprocess:
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]

    app = ProxyApp(
        routes=[
            Route("/health", proxy.health, methods=["GET"]),
            Route("/ready", proxy.ready, methods=["GET"]),
            Route("/metrics", proxy.metrics_endpoint, methods=["GET"]),
        ],
        lifespan=lifespan,
    )
    app.state.proxy = proxy
    return app


class ProxyApp(Starlette):
    """Starlette for the proxy's own routes and its lifespan; ``/v1/...`` goes straight to
    ``Proxy.proxy``, ahead of Starlette's middleware and router."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(API_PREFIX + "/"):
            if scope["method"] not in _PROXIED_METHODS:
                message = f"method {scope['method']} is not proxied"
                headers = {"allow": ", ".join(_PROXIED_METHODS)}
                await error_response(405, message, headers)(scope, receive, send)
                return
            await self.state.proxy.proxy(scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def app_from_environment() -> ProxyApp:
    """The app factory of ``--workers N``: each worker process reads the config the CLI resolved."""
    text = os.environ.get(CONFIG_ENV)
    if not text:
        raise RuntimeError(f"${CONFIG_ENV} is not set: start workers with `pdclient serve --workers N`")
    return create_app(ServeConfig.from_json(text))


__all__ = ["Proxy", "ProxyApp", "app_from_environment", "create_app", "readiness"]
