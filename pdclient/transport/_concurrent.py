"""A decode leg in flight while its prefill runs (``handoff._dispatch``), and how it is cut.

The sync twin sends it from a thread: its caller's thread runs the prefill and, when the
prefill fails or ran elsewhere, or the call ends with an exception (a Ctrl-C while the
decode's headers are awaited too), cuts the decode's connection (a shutdown of its socket
ends a read blocked in the other thread; the decode server sees the client go away and
aborts the request, freeing its blocks). The async twin sends it from a task and cancels
it. Either way a decode already answered (headers in) is closed instead. The decode
server's ``push_registration_timeout`` only backs this up, for a leg transport without a
socket to cut.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import AsyncIterator, Iterator

import anyio
import httpx

from ..handoff import RELEASE_TIMEOUT, STREAM_ERRORS, Call, dispatch
from ._leg_client import AsyncLegClient, LegClient

_CONNECTED = "connection.connect_tcp.complete"


class DecodeCancelled(Exception):
    """How a cancelled concurrent decode's leg ends: by the client's choice, saying nothing of its server."""


def _cancelled(error: BaseException | None) -> BaseException:
    return error if error is not None else DecodeCancelled("cancelled: its prefill failed or ran elsewhere")


def _failure(response: httpx.Response | None, error: BaseException | None) -> str | None:
    """Why a concurrent decode cannot be the caller's answer (it is then sent again, sequentially)."""
    if error is not None:
        return f"the decode failed: {type(error).__name__}: {error}".rstrip(": ")
    if response is None:
        return "the decode gave no answer"
    if response.status_code >= 400:
        return f"the decode answered HTTP {response.status_code}"
    return None


def _broke_early(error: BaseException) -> str:
    return f"the decode's stream broke before its first event: {type(error).__name__}: {error}".rstrip(": ")


class _Replayed(httpx.SyncByteStream):
    """A response body whose first chunks were read already: them, then the rest of the same read."""

    def __init__(self, read: list[bytes], rest: Iterator[bytes], stream: httpx.SyncByteStream) -> None:
        self._read, self._rest, self._stream = read, rest, stream

    def __iter__(self) -> Iterator[bytes]:
        read, self._read = self._read, []
        yield from read
        yield from self._rest

    def close(self) -> None:
        self._stream.close()


class _AsyncReplayed(httpx.AsyncByteStream):
    """Async twin of ``_Replayed``."""

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

    def __init__(self, legs: LegClient, request: httpx.Request, call: Call) -> None:
        self._call = call
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._response: httpx.Response | None = None
        self._error: BaseException | None = None
        self._stream: object = None
        self._cancelled = False

        def watch(event: str, info: dict[str, object]) -> None:
            call.decode_event(event)
            if event == _CONNECTED:
                self._stream = info.get("return_value")

        request.extensions["trace"] = watch
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

    def result(self) -> httpx.Response | None:
        """The decode's response, headers in, body unread; None when it failed (``failure``)."""
        self._done.wait()
        return self._response

    def failure(self, response: httpx.Response | None) -> str | None:
        why = _failure(response, self._error)
        if self._error is not None:
            self._call.decode_attempt_failed(self._error)
        return why

    def check_prompt(self, response: httpx.Response, sent: dispatch.ConcurrentDecode) -> str | None:
        """Why the answered decode is not the handoff's (``dispatch.prompt_drift``), from its first event."""
        peek = dispatch.prompt_peek(self._call)
        stream = response.stream
        assert isinstance(stream, httpx.SyncByteStream)
        chunks = iter(stream)
        read: list[bytes] = []
        try:
            for chunk in chunks:
                read.append(chunk)
                if peek.feed(chunk):
                    break
        except STREAM_ERRORS as exc:
            return _broke_early(exc)
        response.stream = _Replayed(read, chunks, stream)
        return dispatch.prompt_drift(self._call, sent, peek.ids)

    def cancel(self) -> None:
        """Abort the decode wherever it is: close its response, or cut its connection."""
        with self._lock:
            self._cancelled = True
            response, self._response = self._response, None
        if response is not None:
            response.close()
            self._call.decode.end(response.status_code, None)
            return
        if not self._done.is_set():
            get_extra_info = getattr(self._stream, "get_extra_info", None)
            sock = get_extra_info("socket") if get_extra_info is not None else None
            if isinstance(sock, socket.socket):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            self._done.wait(RELEASE_TIMEOUT)
        self._call.decode.end(None, _cancelled(self._error))


class AsyncDecodeInFlight:
    """Async twin of ``DecodeInFlight``: sent from a task (``run``) of the call's task group."""

    def __init__(self, legs: AsyncLegClient, request: httpx.Request, call: Call) -> None:
        self._legs = legs
        self._request = request
        self._call = call
        self._scope = anyio.CancelScope()
        self._response: httpx.Response | None = None
        self._error: BaseException | None = None
        self._cancelled = False

        async def watch(event: str, info: dict[str, object]) -> None:
            call.decode_event(event)

        request.extensions["trace"] = watch

    async def run(self) -> None:
        with self._scope:
            try:
                self._response = await self._legs.send(self._request)
            except Exception as exc:
                self._error = exc

    def result(self) -> httpx.Response | None:
        return self._response

    def failure(self, response: httpx.Response | None) -> str | None:
        why = _failure(response, self._error)
        if self._error is not None:
            self._call.decode_attempt_failed(self._error)
        return why

    async def check_prompt(self, response: httpx.Response, sent: dispatch.ConcurrentDecode) -> str | None:
        peek = dispatch.prompt_peek(self._call)
        stream = response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        chunks = aiter(stream)
        read: list[bytes] = []
        try:
            async for chunk in chunks:
                read.append(chunk)
                if peek.feed(chunk):
                    break
        except STREAM_ERRORS as exc:
            return _broke_early(exc)
        response.stream = _AsyncReplayed(read, chunks, stream)
        return dispatch.prompt_drift(self._call, sent, peek.ids)

    def cancel(self) -> None:
        """Abort the decode: its task is cancelled (its connection closed); ``discard`` closes a response."""
        self._cancelled = True
        self._scope.cancel()

    async def discard(self) -> None:
        """Close what the cancelled or failed decode left, shielded: a leaving caller still frees it."""
        response, self._response = self._response, None
        if response is not None:
            with anyio.CancelScope(shield=True):
                await response.aclose()
            self._call.decode.end(response.status_code, None)
            return
        self._call.decode.end(None, _cancelled(self._error))


__all__ = ["AsyncDecodeInFlight", "DecodeInFlight"]
