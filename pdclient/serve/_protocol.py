"""The proxy's client connections: uvicorn's httptools HTTP/1.1 protocol (the one uvicorn's
``auto`` picks), with deadlines on each request's head and body.

uvicorn bounds a connection's idle time between requests (``timeout_keep_alive``) and the
requests it serves at once (``limit_concurrency``), but not the time a request takes to
arrive, nor (with httptools) its head's size: a client sending its headers one byte every
half second holds a connection, and its file descriptor, for as long as it likes. Here a
request's line and headers must be whole within ``header_timeout`` seconds of their first
byte, or of the connection for one that sends nothing, and be no larger than
``max_header_size`` bytes; then its body must be whole within
``body_timeout`` seconds. Else the connection is closed, after a 431 or a 408 when no
answer has started.

The deadlines are timers on the event loop, set and cancelled as the parser reads: the
app's own ``anyio.fail_after`` around its body read cost ~17 us per call, ~3 % of the
proxy's CPU.

A request whose head is whole also brings uvicorn's ``Date`` header up to the second
(``refresh_date``): uvicorn refreshes it on its main loop's tick, once a second, and the
proxy's main loop (``_server.Server``) no longer wakes an idle process every second for it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from email.utils import formatdate
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol  # httptools: a dependency of the extra
from uvicorn.server import ServerState


def _refusal(status: bytes, message: bytes) -> bytes:
    return (
        b"HTTP/1.1 " + status + b"\r\ncontent-type: text/plain; charset=utf-8\r\n"
        b"content-length: " + str(len(message)).encode("ascii") + b"\r\nconnection: close\r\n\r\n" + message
    )


_HEAD_TOO_LARGE = _refusal(b"431 Request Header Fields Too Large", b"request headers are too large\n")
_BODY_TOO_SLOW = _refusal(b"408 Request Timeout", b"request body not received in time\n")


_date: tuple[int, bytes] = (-1, b"")
"""The second and its ``Date`` value, formatted once for every request in that second."""


def refresh_date(state: ServerState) -> None:
    """uvicorn's ``Date`` header (the first of its default headers, when it sends one) as of
    now, for the request whose head just ended and those after it."""
    global _date
    headers = state.default_headers
    if not headers or headers[0][0] != b"date":
        return  # ``date_header=False``, or before the server's first tick
    second = int(time.time())
    if second != _date[0]:
        _date = (second, formatdate(second, usegmt=True).encode())
    if headers[0][1] is not _date[1]:
        state.default_headers = [(b"date", _date[1]), *headers[1:]]


class ServerConfig(uvicorn.Config):
    """``uvicorn.Config`` with the limits the connections below read, and their protocol."""

    def __init__(
        self, app: Any, *, header_timeout: float, body_timeout: float, max_header_size: int, **kwargs: Any
    ) -> None:
        kwargs.setdefault("http", HttpToolsConnection)  # as uvicorn's "auto" picks: its C parser
        kwargs.setdefault("h11_max_incomplete_event_size", max_header_size)
        super().__init__(app, **kwargs)
        self.header_timeout = header_timeout
        self.body_timeout = body_timeout
        self.max_header_size = max_header_size


class _Deadline:
    """A timer that calls ``expired`` unless stopped within ``seconds`` (None: never)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float | None, expired: Callable[[], None]) -> None:
        self._loop = loop
        self._seconds = seconds
        self._expired = expired
        self._timer: asyncio.TimerHandle | None = None

    @property
    def running(self) -> bool:
        return self._timer is not None

    def start(self) -> None:
        self.stop()
        if self._seconds is not None:
            self._timer = self._loop.call_later(self._seconds, self._expire)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        self._expired()


class _Deadlines:
    """The deadlines, and what their expiry does."""

    transport: asyncio.Transport
    cycle: Any  # uvicorn's RequestResponseCycle of the request being read (None before the first)

    def _start_deadlines(self, config: uvicorn.Config, loop: asyncio.AbstractEventLoop) -> None:
        self.head = _Deadline(loop, getattr(config, "header_timeout", None), self._close)
        self.body = _Deadline(loop, getattr(config, "body_timeout", None), self._body_too_slow)

    def _stop_deadlines(self) -> None:
        self.head.stop()
        self.body.stop()

    def _head_too_large(self) -> None:
        self._stop_deadlines()
        if self.cycle is None or self.cycle.response_complete:  # else the answer to the one before goes on
            self.transport.write(_HEAD_TOO_LARGE)
        self._close()

    def _body_too_slow(self) -> None:
        self._stop_deadlines()
        if self.cycle is not None and not self.cycle.response_started:  # the app is still waiting for it
            self.transport.write(_BODY_TOO_SLOW)
        self._close()

    def _close(self) -> None:
        if not self.transport.is_closing():
            self.transport.close()


class HttpToolsConnection(_Deadlines, HttpToolsProtocol):
    """uvicorn's httptools protocol with the deadlines and a bound on the head's size."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self._start_deadlines(config, self.loop)
        self._max_head: int | None = getattr(config, "max_header_size", None)
        self._in_head = False
        self._head_bytes = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.head.start()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_deadlines()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        was_in_head = self._in_head
        super().data_received(data)
        if not self._in_head or self.transport.is_closing():
            return
        # Counted from the read its head began in (a little more than the head, at most one read).
        self._head_bytes = self._head_bytes + len(data) if was_in_head else len(data)
        if self._max_head is not None and self._head_bytes > self._max_head:
            self._head_too_large()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        self.head.start()  # from the head's first byte

    def on_headers_complete(self) -> None:
        self._in_head = False
        self.head.stop()
        self.body.start()
        refresh_date(self.server_state)  # before the request's cycle takes the default headers
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.body.stop()
        super().on_message_complete()


__all__ = ["HttpToolsConnection", "ServerConfig", "refresh_date"]
