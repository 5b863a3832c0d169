"""The proxy's leg transport: aiohttp behind httpx's transport interface.

A proxy sends two leg requests per call, and the HTTP client is most of its CPU: httpx
with httpcore spent 1.1-1.4 ms of CPU per leg request against the loopback stub here,
aiohttp 0.3-0.5 ms (its parser is C). ``AsyncPDTransport`` takes any
``httpx.AsyncBaseTransport`` for its legs (``leg_transport=``), so the core is unchanged:
it gets httpx responses, streamed, and aiohttp's failures as the httpx errors its retry,
breaker and KV-release decisions are written against:

==========================================  ====================================
aiohttp                                     httpx
==========================================  ====================================
connection refused, DNS failure             ``ConnectError`` (nothing was sent)
connect timeout                             ``ConnectTimeout``
read timeout (``sock_read``)                ``ReadTimeout``
server closed the connection, bad HTTP      ``RemoteProtocolError``
other socket errors                         ``ReadError``
==========================================  ====================================

httpcore's ``trace`` extension is honoured for the one event the core watches (the
request's headers going out: from then on the server may have the request).

``HTTP(S)_PROXY`` / ``NO_PROXY`` are honoured as httpx honours them, read once per server
origin: aiohttp's own ``trust_env`` reads them, and ``~/.netrc``, in a worker thread on
every request (two thread hops per leg, measured ~10 % of the proxy's CPU per call).

Credentials in a server's URL (``http://user:password@host/v1``) go as Basic auth, as the
clients' legs send them (``transport._leg_client``): they replace any ``Authorization`` the request
had, and aiohttp gets the URL without them (it refuses a URL with credentials beside an
``Authorization`` header, and would show them in its errors).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import aiohttp
import httpx
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

from ..transport import IDLE_CONNECTION_SECONDS, with_url_auth  # the clients' rules, so both send the same
from ..wire import HOP_BY_HOP

_SENDING = "http11.send_request_headers.started"
# Hop-by-hop (aiohttp frames the body it sends itself).
_DROPPED = HOP_BY_HOP

Trace = Callable[[str, dict[str, Any]], Awaitable[None]]


async def _headers_sent(session: aiohttp.ClientSession, context: SimpleNamespace, params: object) -> None:
    trace: Trace | None = (context.trace_request_ctx or {}).get("trace")
    if trace is not None:
        await trace(_SENDING, {})


def _header_text(value: bytes) -> str:
    """A header value as the str aiohttp takes: it writes values as UTF-8, so UTF-8 bytes pass
    unchanged; other bytes beyond ASCII (rare: Latin-1 from an old client) go as UTF-8 of
    their Latin-1 reading, the only way aiohttp can send them."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


def _httpx_error(exc: BaseException, request: httpx.Request) -> httpx.TransportError:
    message = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return httpx.ConnectTimeout(message, request=request)
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(message, request=request)
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's SocketTimeoutError and ServerTimeoutError too
        return httpx.ReadTimeout(message, request=request)
    if isinstance(exc, aiohttp.ServerDisconnectedError | aiohttp.ClientPayloadError | aiohttp.ClientResponseError):
        return httpx.RemoteProtocolError(message, request=request)
    return httpx.ReadError(message, request=request)


class AiohttpTransport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` sending requests with one pooled ``aiohttp.ClientSession``
    (made on first use, in the running event loop)."""

    def __init__(self, *, max_connections: int = 1000) -> None:
        self._max_connections = max_connections
        self._connector: aiohttp.TCPConnector | None = None
        self._sessions: dict[bool, aiohttp.ClientSession] = {}
        self._proxies: dict[tuple[str, str, int | None], tuple[URL | None, aiohttp.BasicAuth | None]] = {}

    def _get_session(self, traced: bool) -> aiohttp.ClientSession:
        """One pool of connections; two sessions on it, as aiohttp's tracing costs every request
        of a session that has it (~4 % of the proxy's CPU) and only decode legs watch for it."""
        session = self._sessions.get(traced)
        if session is None:
            if self._connector is None:
                self._connector = aiohttp.TCPConnector(
                    limit=self._max_connections, limit_per_host=0, keepalive_timeout=IDLE_CONNECTION_SECONDS
                )
            traces = [aiohttp.TraceConfig()] if traced else []
            for trace in traces:
                trace.on_request_headers_sent.append(_headers_sent)
            session = self._sessions[traced] = aiohttp.ClientSession(
                connector=self._connector,
                connector_owner=False,
                trace_configs=traces,
                auto_decompress=False,  # bodies pass as the servers sent them, as with httpcore
                cookie_jar=aiohttp.DummyCookieJar(),
                skip_auto_headers=("User-Agent", "Accept-Encoding", "Accept", "Content-Type"),
            )
        return session

    def _proxy_for(self, url: httpx.URL) -> tuple[URL | None, aiohttp.BasicAuth | None]:
        """The proxy the environment names for ``url``'s origin (as the clients' httpx legs and
        openai honour it), or none; looked up once per origin."""
        origin = (url.scheme, url.host, url.port)
        if origin not in self._proxies:
            try:
                self._proxies[origin] = get_env_proxy_for_url(URL(str(url)))
            except LookupError:
                self._proxies[origin] = (None, None)
        return self._proxies[origin]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        url = request.url
        if url.userinfo:
            request = with_url_auth(request)
            url = url.copy_with(userinfo=b"")
        timeouts = request.extensions.get("timeout") or {}
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=timeouts.get("pool"),
            sock_connect=timeouts.get("connect"),
            sock_read=timeouts.get("read"),
        )
        headers = [
            (name.decode("latin-1"), _header_text(value))
            for name, value in request.headers.raw
            if name.lower() not in _DROPPED
        ]
        # In memory (a leg's body, or none for a GET), or a pass-through upload streamed as it arrives.
        stream = request.stream
        data = (b"".join(stream) or None) if isinstance(stream, httpx.ByteStream) else _body_of(request)
        proxy, proxy_auth = self._proxy_for(url)
        trace = request.extensions.get("trace")
        try:
            response = await self._get_session(trace is not None).request(
                request.method,
                str(url),
                headers=headers,
                data=data,
                timeout=timeout,
                proxy=proxy,
                proxy_auth=proxy_auth,
                allow_redirects=False,
                trace_request_ctx={"trace": trace},
            )
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise _httpx_error(exc, request) from exc
        deadline = None
        read = timeout.sock_read
        connection = response.connection
        if read is not None and connection is not None and connection.protocol is not None:
            # From here the body's reads are bounded by a deadline of its own, not by aiohttp's
            # sock_read, which cancels and sets a timer anew at every arrival.
            connection.protocol.read_timeout = None
            deadline = _ReadDeadline(response.content, read)
        return httpx.Response(
            response.status,
            headers=response.raw_headers,  # as bytes: a value beyond ASCII passes as it came
            stream=_Body(response, request, deadline),
            extensions={"http_version": b"HTTP/1.1", "reason_phrase": (response.reason or "").encode("latin-1")},
        )

    async def aclose(self) -> None:
        sessions, self._sessions = self._sessions, {}
        for session in sessions.values():
            await session.close()
        if self._connector is not None:
            await self._connector.close()
            self._connector = None


async def _body_of(request: httpx.Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream:  # type: ignore[union-attr]
        yield chunk


class _ReadDeadline:
    """How long a body's read may wait with nothing arriving (the leg's read timeout, as
    aiohttp's ``sock_read`` bounds it), on one timer a body.

    aiohttp cancels its timer and sets another at every arrival: a decode arrives a token at
    a time, and that was ~5 us of CPU a read on the Zen 4 EPYC, a tenth of the leg's (its
    reads against a stub's 200-event stream, interleaved with and without ``sock_read``).
    Here the timer is set when a read begins with none pending and, when it fires, set again
    for the deadline of the read that is waiting then; a read that waits past its deadline
    gets aiohttp's own timeout error. A caller slow to ask for the next chunk is not the
    server's silence: with no read waiting, the timer lapses until the next read.
    """

    __slots__ = ("_content", "_loop", "_seconds", "_since", "_timer")

    def __init__(self, content: aiohttp.StreamReader, seconds: float) -> None:
        self._content = content
        self._seconds = seconds
        self._loop = asyncio.get_running_loop()
        self._since: float | None = None
        self._timer: asyncio.TimerHandle | None = None

    def reading(self) -> None:
        self._since = now = self._loop.time()
        if self._timer is None:
            self._timer = self._loop.call_at(now + self._seconds, self._due)

    def read(self) -> None:
        self._since = None

    def stop(self) -> None:
        self._since = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        if self._since is None:
            return
        deadline = self._since + self._seconds
        if self._loop.time() < deadline:
            self._timer = self._loop.call_at(deadline, self._due)
        else:
            self._content.set_exception(aiohttp.SocketTimeoutError("Timeout on reading data from socket"))


class _Body(httpx.AsyncByteStream):
    """A response body as it arrives; closing it before its end closes the connection."""

    def __init__(
        self, response: aiohttp.ClientResponse, request: httpx.Request, deadline: _ReadDeadline | None
    ) -> None:
        self._response = response
        self._request = request
        self._deadline = deadline

    def __aiter__(self) -> _Chunks:
        return _Chunks(self._response, self._request, self._deadline)

    async def aclose(self) -> None:
        if self._deadline is not None:
            self._deadline.stop()
        if self._response.content.at_eof():
            self._response.release()  # read to its end: the connection goes back to the pool
        else:
            self._response.close()  # abandoned: the server sees the connection close


_SINKS: dict[int, Callable[[bytes | None], None]] = {}
"""Where each pushing reader's chunks go, by the reader's id (aiohttp's readers have slots only)."""


class _PushingReader(aiohttp.StreamReader):
    """An aiohttp body reader whose chunks go to its sink as the parser feeds them, unbuffered
    (``_Chunks.push``). Its end or its error goes to the reader as always (it answers the
    next read with it), and then to the sink as None. Same slots: a reader's class is
    swapped to it and back."""

    __slots__ = ()

    def feed_data(self, data: bytes, *args: Any) -> bool:
        if data:
            _SINKS[id(self)](data)
        return False

    def feed_eof(self) -> None:
        sink = _unpushed(self)
        aiohttp.StreamReader.feed_eof(self)  # not super(): the class is aiohttp's again
        sink(None)

    def set_exception(self, exc: BaseException, *args: Any) -> None:
        sink = _unpushed(self)
        aiohttp.StreamReader.set_exception(self, exc, *args)
        sink(None)


def _timed(sink: Callable[[bytes | None], None], deadline: _ReadDeadline) -> Callable[[bytes | None], None]:
    """``sink``, each chunk it is given starting the read deadline's wait again."""

    def timed(chunk: bytes | None) -> None:
        if chunk is not None:
            deadline.reading()
        sink(chunk)

    return timed


def _unpushed(reader: aiohttp.StreamReader) -> Callable[[bytes | None], None]:
    """``reader`` back to a plain reader; the sink it pushed to."""
    reader.__class__ = aiohttp.StreamReader
    return _SINKS.pop(id(reader))


class _Chunks:
    """A body's chunks, each as aiohttp's buffer holds it when read (``readany``), or pushed
    as the parser feeds them (``transport.Pushing``, for a relay). An iterator of its own,
    not an async generator over ``iter_any()``: a streamed answer is read a token at a
    time, and each of those two layers costs every chunk a frame's resumption."""

    __slots__ = ("_content", "_cut", "_deadline", "_request")

    def __init__(
        self, response: aiohttp.ClientResponse, request: httpx.Request, deadline: _ReadDeadline | None
    ) -> None:
        self._content = response.content
        self._request = request
        self._deadline = deadline
        self._cut: BaseException | None = None

    def __aiter__(self) -> _Chunks:
        return self

    async def __anext__(self) -> bytes:
        if self._cut is not None:
            raise self._cut
        deadline = self._deadline
        if deadline is not None:
            deadline.reading()
        try:
            chunk = await self._content.readany()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            error = _httpx_error(exc, self._request)
            error.__cause__ = exc
            rest = _buffered(self._content)
            if rest:  # what arrived before the cut goes on first, as with httpcore
                self._cut = error
                return rest
            raise error from exc
        finally:
            if deadline is not None:
                deadline.read()
        if not chunk:
            if deadline is not None:
                deadline.stop()
            raise StopAsyncIteration
        return chunk

    def push(self, sink: Callable[[bytes | None], None]) -> bool:
        content = self._content
        if type(content) is not aiohttp.StreamReader or self._cut is not None:
            return False  # a reader of another kind (an empty body), or a cut to raise: read as always
        if content._buffer or content.is_eof() or content.exception() is not None:
            return False  # something to read now
        deadline = self._deadline
        if deadline is not None:
            # A pushed body waits as a read does: the server's silence past the read
            # timeout ends it (the reader's error, then the sink's None), each chunk
            # starting the wait again.
            deadline.reading()
            sink = _timed(sink, deadline)
        _SINKS[id(content)] = sink
        content.__class__ = _PushingReader
        return True

    def stop(self) -> None:
        if type(self._content) is _PushingReader:
            _unpushed(self._content)
        if self._deadline is not None:
            self._deadline.read()  # no read waits until the next one begins


def _buffered(stream: aiohttp.StreamReader) -> bytes:
    """The bytes a broken body had received: aiohttp raises its error before handing out its
    buffer, so it is read with its own internal reader (empty if that ever changes)."""
    read = getattr(stream, "_read_nowait", None)
    try:
        return bytes(read(-1)) if read is not None and stream._buffer else b""
    except Exception:
        return b""
