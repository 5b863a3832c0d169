"""The proxy as an ASGI app (Starlette): its own routes (``/health``, ``/ready``, ``/metrics``),
its lifespan (the fleet's background work, the first probes, the shutdown signals), and
``/v1`` straight to ``Proxy.proxy``; the app factory of ``--workers N``."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import httpx
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from .. import __version__
from ..wire import FAILED_LEG_HEADER
from ._config import CONFIG_ENV, ServeConfig
from ._paths import API_PREFIX
from ._proxy import PROXIED_METHODS, Proxy, error_response
from ._readiness import first_probes
from ._signals import on_shutdown_signal
from ._summary import startup_summary

logger = logging.getLogger("pdclient.serve")


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
        # The fleet's background work (health checks, discovery, load scrapes) starts with the
        # app, not with its first call: /ready is right before any traffic.
        fleet = proxy.transport.fleet
        fleet.start()
        options = proxy.transport.options
        if options.remote_prefill == "auto" and options.conversations.warm_prefill:
            fleet.start_warm_ups()
        await first_probes(fleet)
        logger.info("pdclient serve %s: %s", __version__, startup_summary(proxy))
        try:
            with on_shutdown_signal(proxy.drain):
                yield
        finally:
            await proxy.transport.aclose()
            if proxy.tracing is not None:
                await anyio.to_thread.run_sync(proxy.tracing.flush)
            if proxy.multiprocess:
                from prometheus_client import multiprocess

                multiprocess.mark_process_dead(os.getpid())  # type: ignore[no-untyped-call]

    routes = [
        Route("/health", proxy.health, methods=["GET"]),
        Route("/ready", proxy.ready, methods=["GET"]),
        Route("/metrics", proxy.metrics_endpoint, methods=["GET"]),
    ]
    return ProxyApp(proxy, routes=routes, lifespan=lifespan)


# The headers a browser page may read from an answer, beyond the CORS-safelisted ones.
_EXPOSED_HEADERS = ("x-request-id", FAILED_LEG_HEADER)


class ProxyApp(Starlette):
    """Starlette for the proxy's own routes and its lifespan; ``/v1/...`` goes straight to
    ``Proxy.proxy``, ahead of Starlette's middleware and router. With allowed origins,
    starlette's ``CORSMiddleware`` comes first, for ``/v1`` too: it answers a browser's
    preflight itself (a preflight carries no key) and adds the CORS headers to answers."""

    def __init__(self, proxy: Proxy, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state.proxy = proxy
        origins = proxy.config.allowed_origins
        self._entry: Callable[[Scope, Receive, Send], Awaitable[None]] = self._dispatch
        if origins:
            self._entry = CORSMiddleware(
                self._dispatch,
                allow_origins=origins,
                allow_methods=PROXIED_METHODS,
                allow_headers=["*"],
                expose_headers=_EXPOSED_HEADERS,
            )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._entry(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(API_PREFIX + "/"):
            if scope["method"] not in PROXIED_METHODS:
                message = f"method {scope['method']} is not proxied"
                headers = {"allow": ", ".join(PROXIED_METHODS)}
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
