"""Sending the legs: a pooled httpx client's transports, without the client's own layers.

An httpx client around each leg request would add, per request, its auth and redirect
loops, a timer wrapper on the body and a cookie jar: ``extract_cookies`` runs
``http.cookiejar`` on every response, ~7 % of ``pdclient serve``'s CPU per call, for
cookies it would never send (the legs are built as requests, not through the client's
``build_request``, which is where a jar's cookies are added). Cookies are the caller's:
their ``Cookie`` header reaches the legs with the request, and the decode's
``Set-Cookie`` goes back in the response the caller's client is handed.

So the client is kept for what it sets up once (the connection pool, the proxy mounts
for ``HTTP(S)_PROXY`` / ``NO_PROXY``), and a leg goes straight to the transport the
client would pick for its URL. What the client would do per request and the legs need is
done here: Basic auth from credentials in a URL, and the request on a transport error.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any, Generic, TypeVar

import httpx

C = TypeVar("C", httpx.Client, httpx.AsyncClient)

IDLE_CONNECTION_SECONDS = 4.0
"""How long a leg's idle connection is kept for reuse: less than vLLM keeps it (uvicorn's
``timeout_keep_alive``, ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``: 5 s). Kept as long as the server
keeps it (httpx's default is 5 s too), the server can close it just as a leg is sent on it:
the leg fails with "Server disconnected without sending a response", and a decode leg is
not sent again (it may have reached the server)."""
# The openai SDK's own pool limits, kept for the legs so a drop-in client pools alike, but for
# the idle time.
LEG_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100, keepalive_expiry=IDLE_CONNECTION_SECONDS)


def _with_url_auth(request: httpx.Request) -> httpx.Request:
    """Credentials in the URL (``http://user:pass@host``) as Basic auth, as httpx's client sends them."""
    url = request.url
    if url.username or url.password:
        return next(httpx.BasicAuth(url.username, url.password).sync_auth_flow(request))
    return request


class _Legs(Generic[C]):
    """What both leg clients share: how a leg finds its transport, and what it carries back."""

    _client: C

    def _route(self, request: httpx.Request) -> tuple[httpx.Request, Any]:
        """The request as it goes out (``_with_url_auth``) and the transport the client would pick for it."""
        request = _with_url_auth(request)
        return request, self._client._transport_for_url(request.url)

    @staticmethod
    @contextlib.contextmanager
    def _sending(request: httpx.Request) -> Iterator[None]:
        """A transport error names the request that went out, as the client's own would."""
        try:
            yield
        except httpx.RequestError as exc:
            exc.request = request
            raise


class LegClient(_Legs[httpx.Client]):
    """Sends each leg, streamed, on ``transport`` (default: a pooled ``httpx.HTTPTransport``)."""

    def __init__(self, transport: httpx.BaseTransport | None = None, *, keep_alive: bool = True) -> None:
        limits = LEG_LIMITS if keep_alive else httpx.Limits(max_connections=None, max_keepalive_connections=0)
        self._client = httpx.Client(transport=transport, limits=limits, timeout=None)
        self._transport = transport
        self._fresh: LegClient | None = None
        self._lock = threading.Lock()

    def fresh_connections(self) -> LegClient:
        """A sibling that opens a new connection per leg and keeps none: a concurrent decode
        goes there, so the caller's thread can cut its connection (a blocked sync read has
        no other way to end) when its prefill fails. On loopback or a LAN a connect costs
        well under a millisecond, against the hundreds the concurrent dispatch saves."""
        with self._lock:
            if self._fresh is None:
                self._fresh = LegClient(self._transport, keep_alive=False)
            return self._fresh

    def send(self, request: httpx.Request) -> httpx.Response:
        """The response with its body unread; the caller closes it."""
        request, transport = self._route(request)
        with self._sending(request):
            response: httpx.Response = transport.handle_request(request)
        response.request = request
        return response

    def close(self) -> None:
        self._client.close()
        if self._fresh is not None:
            self._fresh.close()


class AsyncLegClient(_Legs[httpx.AsyncClient]):
    """Async twin of ``LegClient``."""

    def __init__(self, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self._client = httpx.AsyncClient(transport=transport, limits=LEG_LIMITS, timeout=None)

    async def send(self, request: httpx.Request) -> httpx.Response:
        """The response with its body unread; the caller closes it."""
        request, transport = self._route(request)
        with self._sending(request):
            response: httpx.Response = await transport.handle_async_request(request)
        response.request = request
        return response

    async def aclose(self) -> None:
        await self._client.aclose()


__all__ = ["IDLE_CONNECTION_SECONDS", "LEG_LIMITS", "AsyncLegClient", "LegClient"]
