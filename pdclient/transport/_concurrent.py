"""A decode leg in flight while its prefill runs (``handoff._dispatch``): the drivers' handles on it.

The flow decides when it is cut (``Cut``) and what its leg ends with (``Discard``); these
handles only run it and stop it. The sync one sends it from a thread: its caller's thread
runs the prefill and, to cut the decode, shuts its connection's socket down (that ends a
read blocked in the other thread; the decode server sees the client go away and aborts the
request, freeing its blocks). The async one sends it from a task and cancels it. Either
way a decode already answered (headers in) is closed instead. The decode server's
``push_registration_timeout`` only backs this up, for a leg transport without a socket to cut.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Awaitable, Callable

import anyio
import httpx

from ..handoff import RELEASE_TIMEOUT
from ._leg_client import AsyncLegClient, LegClient

_CONNECTED = "connection.connect_tcp.complete"
_Outcome = tuple[httpx.Response | None, BaseException | None]


class _InFlight:
    """What both handles share: the decode's outcome, and how a cut decode's leg ends."""

    _response: httpx.Response | None = None
    _error: BaseException | None = None

    def _taken(self) -> httpx.Response | None:
        """The response, now the taker's to close (None: there was none, or it was taken)."""
        response, self._response = self._response, None
        return response

    def _ended(self, closed: httpx.Response | None) -> tuple[int | None, BaseException | None]:
        """What the leg ends with once its response (if any) is closed: its status, or its error."""
        return (closed.status_code, None) if closed is not None else (None, self._error)


class _Connection:
    """The connection a sync leg went out on, as httpcore's trace names it: cutting it ends a
    read blocked on it in another thread (and its server sees the client go away)."""

    def __init__(self, watch: Callable[[str], None]) -> None:
        self._watch = watch
        self._stream: object = None

    def trace(self, event: str, info: dict[str, object]) -> None:
        self._watch(event)
        if event == _CONNECTED:
            self._stream = info.get("return_value")

    def cut(self) -> None:
        get_extra_info = getattr(self._stream, "get_extra_info", None)
        sock = get_extra_info("socket") if get_extra_info is not None else None
        if isinstance(sock, socket.socket):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def async_trace(watch: Callable[[str], None]) -> Callable[[str, dict[str, object]], Awaitable[None]]:
    """httpcore's trace hook for a request sent with ``await``: ``watch`` sees each event's name."""

    async def trace(event: str, info: dict[str, object]) -> None:
        watch(event)

    return trace


class DecodeInFlight(_InFlight):
    """The concurrent decode of one call, sent from a thread of its own."""

    def __init__(self, legs: LegClient, request: httpx.Request, watch: Callable[[str], None]) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._cancelled = False
        self._connection = _Connection(watch)
        request.extensions["trace"] = self._connection.trace
        worker = threading.Thread(
            target=self._send, args=(legs, request), name="pdclient-concurrent-decode", daemon=True
        )
        worker.start()

    def _send(self, legs: LegClient, request: httpx.Request) -> None:
        try:
            response = legs.send(request)
        except BaseException as exc:
            self._error = exc
        else:
            with self._lock:
                cancelled = self._cancelled
                self._response = None if cancelled else response
            if cancelled:
                response.close()
        finally:
            self._done.set()

    def outcome(self) -> _Outcome:
        """The decode's response (headers in, body unread) or its error, once it has one."""
        self._done.wait()
        return self._response, self._error

    def cut(self) -> None:
        """Abort the decode wherever it is: a response it gets from now on is closed, a
        request still waiting for one has its connection cut."""
        with self._lock:
            self._cancelled = True
            waiting = self._response is None
        if waiting and not self._done.is_set():
            self._connection.cut()

    def discard(self) -> tuple[int | None, BaseException | None]:
        with self._lock:
            response = self._taken()
        if response is not None:
            response.close()
        else:
            self._done.wait(RELEASE_TIMEOUT)
        return self._ended(response)


class AsyncDecodeInFlight(_InFlight):
    """The concurrent decode of one call, sent from a task (``run``) of the driver's task group."""

    def __init__(self, legs: AsyncLegClient, request: httpx.Request, watch: Callable[[str], None]) -> None:
        self._legs, self._request = legs, request
        self.scope = anyio.CancelScope()
        request.extensions["trace"] = async_trace(watch)

    async def run(self) -> None:
        with self.scope:
            try:
                self._response = await self._legs.send(self._request)
            except Exception as exc:
                self._error = exc

    async def outcome(self) -> _Outcome:
        return self._response, self._error

    async def cut(self) -> None:
        self.scope.cancel()

    async def discard(self) -> tuple[int | None, BaseException | None]:
        response = self._taken()
        if response is not None:
            with anyio.CancelScope(shield=True):
                await response.aclose()
        return self._ended(response)


__all__ = ["AsyncDecodeInFlight", "DecodeInFlight", "async_trace"]
