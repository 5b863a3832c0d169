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
from collections.abc import AsyncIterator, Callable, Iterator

import anyio
import httpx

from ..handoff import RELEASE_TIMEOUT
from ._leg_client import AsyncLegClient, LegClient

_CONNECTED = "connection.connect_tcp.complete"
_Outcome = tuple[httpx.Response | None, BaseException | None]


class Replayed(httpx.SyncByteStream):
    """A response body whose first chunks were read already: them, then the rest of the same read."""

    def __init__(self, read: list[bytes], rest: Iterator[bytes], stream: httpx.SyncByteStream) -> None:
        self._read, self._rest, self._stream = read, rest, stream

    def __iter__(self) -> Iterator[bytes]:
        read, self._read = self._read, []
        yield from read
        yield from self._rest

    def close(self) -> None:
        self._stream.close()


class AsyncReplayed(httpx.AsyncByteStream):
    """Async twin of ``Replayed``."""

    def __init__(self, read: list[bytes], rest: AsyncIterator[bytes], stream: httpx.AsyncByteStream) -> None:
        self._read, self._rest, self._stream = read, rest, stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        read, self._read = self._read, []
        for chunk in read:
            yield chunk
        async for chunk in self._rest:
            yield chunk

    async def aclose(self) -> None:
        await self._stream.aclose()


class DecodeInFlight:
    """The concurrent decode of one call, sent from a thread of its own."""

    def __init__(self, legs: LegClient, request: httpx.Request, watch: Callable[[str], None]) -> None:
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._response: httpx.Response | None = None
        self._error: BaseException | None = None
        self._stream: object = None
        self._cancelled = False

        def trace(event: str, info: dict[str, object]) -> None:
            watch(event)
            if event == _CONNECTED:
                self._stream = info.get("return_value")

        request.extensions["trace"] = trace
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

    def result(self) -> _Outcome:
        """The decode's response (headers in, body unread) or its error, once it has one."""
        self._done.wait()
        return self._response, self._error

    def cancel(self) -> None:
        """Abort the decode wherever it is: a response it gets from now on is closed, a
        request still waiting for one has its connection cut."""
        with self._lock:
            self._cancelled = True
            waiting = self._response is None
        if waiting and not self._done.is_set():
            get_extra_info = getattr(self._stream, "get_extra_info", None)
            sock = get_extra_info("socket") if get_extra_info is not None else None
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def discard(self) -> tuple[int | None, BaseException | None]:
        with self._lock:
            response, self._response = self._response, None
        if response is not None:
            response.close()
            return response.status_code, None
        self._done.wait(RELEASE_TIMEOUT)
        return None, self._error


class AsyncDecodeInFlight:
    """The concurrent decode of one call, sent from a task (``run``) of the driver's task group."""

    def __init__(self, legs: AsyncLegClient, request: httpx.Request, watch: Callable[[str], None]) -> None:
        self._legs = legs
        self._request = request
        self._scope = anyio.CancelScope()
        self._response: httpx.Response | None = None
        self._error: BaseException | None = None

        async def trace(event: str, info: dict[str, object]) -> None:
            watch(event)

        request.extensions["trace"] = trace

    async def run(self) -> None:
        with self._scope:
            try:
                self._response = await self._legs.send(self._request)
            except Exception as exc:
                self._error = exc

    def result(self) -> _Outcome:
        return self._response, self._error

    def cancel(self) -> None:
        self._scope.cancel()

    async def discard(self) -> tuple[int | None, BaseException | None]:
        response, self._response = self._response, None
        if response is not None:
            with anyio.CancelScope(shield=True):
                await response.aclose()
            return response.status_code, None
        return None, self._error


__all__ = ["AsyncDecodeInFlight", "AsyncReplayed", "DecodeInFlight", "Replayed"]
