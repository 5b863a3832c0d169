"""The decode body of an armed call (``migration._core``): tracked, and moved when it breaks.

``MigratingDecodeStream`` replaces ``transport._streams.DecodeStream`` for a call that may move. It
passes the caller whole SSE events (``migration._core.Tracker``); when the decode stream breaks
(a reset, a server gone, a read timeout between chunks) it runs the move's steps
(``handoff.move``, a flow of steps: whether it may move, a continuation on another decode
endpoint, through a prefill endpoint first for a long prompt) with its transport's driver
(``_drivers``), and splices the continuation's events into the same body. A stream that
may not move raises the openai error of ``transport._streams`` with the reason.
A stream cut once its answer had ended does not move: it is ended as vLLM ends one.

A non-streamed call that may move streams its decode leg all the same; the events go into
an ``migration._core.Assembler`` instead of to the caller, who gets the JSON body at the end.

Observers see each continuation as another decode leg attempt (and its prefill, if any,
as another prefill attempt); the sync and async twins differ only by ``await``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import httpx

from ..handoff import STREAM_ERRORS, Call, Move, move
from ..migration import Assembler, CallMigration, CannotAssemble
from ..wire import EventTooLarge
from ._streams import AsyncDecodeStream, DecodeStream, _until_error, _until_error_async

if TYPE_CHECKING:
    from ._drivers import AsyncDriver, SyncDriver


def _movable(response: httpx.Response, call: Call) -> CallMigration | None:
    migration = call.migration
    if migration is None or not migration.armed or response.status_code != 200:
        return None
    content_type: str = response.headers.get("content-type", "")
    return migration if content_type.startswith("text/event-stream") else None


def _answers_json(response: httpx.Response, migration: CallMigration) -> None:
    """A non-streamed call gets JSON: the response's headers say so before the call reads them
    (its usage merge is made for a JSON body, and the SDK parses what they name)."""
    if migration.assembles:
        response.headers["content-type"] = "application/json"


def decode_stream(response: httpx.Response, call: Call, driver: SyncDriver) -> httpx.SyncByteStream:
    """The caller's body: a ``MigratingDecodeStream`` if the call may move, else a plain ``DecodeStream``."""
    migration = _movable(response, call)
    if migration is None:
        return DecodeStream(response, call)
    _answers_json(response, migration)
    return MigratingDecodeStream(response, call, migration, driver)


def async_decode_stream(response: httpx.Response, call: Call, driver: AsyncDriver) -> httpx.AsyncByteStream:
    migration = _movable(response, call)
    if migration is None:
        return AsyncDecodeStream(response, call)
    _answers_json(response, migration)
    return AsyncMigratingDecodeStream(response, call, migration, driver)


class _Body:
    """What the twins share besides I/O: where the tracked events go, and how the body ends."""

    def __init__(self, response: httpx.Response, call: Call, migration: CallMigration) -> None:
        self._response = response
        self._call = call
        self._migration = migration
        assert migration.tracker is not None
        self._tracker = migration.tracker
        self._assembler = (
            Assembler(chat=self._tracker.chat, keep_ids=migration.caller_wants_ids) if migration.assembles else None
        )
        self._received = 0
        self._first = True
        self._closed = False
        self._drained = False

    def _moving(self, error: httpx.TransportError | httpx.DecodingError) -> Move:
        """The move's steps (``handoff._move.move``), once the broken response is closed."""
        self._broke(error)
        return move(self._call, self._migration, error, self._received)

    def _pass_on(self, events: list[bytes]) -> bytes:
        """Events the tracker passed on: the caller's now (a stream), or the body's (assembled)."""
        if not events:
            return b""
        self._migration.delivered(time.perf_counter())
        if self._assembler is not None:
            try:
                self._assembler.feed(b"".join(events))
            except CannotAssemble as exc:
                raise self._unassembled(exc) from None
            return b""
        if self._first:
            self._first = False
            self._call.first_byte()
        return self._call.caller_body.events(events)

    def _end(self) -> bytes:
        """The body's last bytes, once the decode's events are over: the assembled body, and
        what the usage merge still holds."""
        self._drained = True
        out = b""
        if self._assembler is not None:
            try:
                body = self._assembler.body(self._migration.usage())
            except CannotAssemble as exc:
                raise self._unassembled(exc) from None
            self._call.first_byte()
            out = self._call.caller_body.feed(body)
        return out + self._call.caller_body.rest()

    def _too_large(self, error: EventTooLarge) -> bytes:
        """The end of a body whose decode sent an event longer than pdclient handles whole."""
        self._drained = True
        self._tracker.cut()
        if self._assembler is not None:
            raise self._unassembled(CannotAssemble(str(error)))
        return self._call.event_too_large(error, self._received)

    def _unassembled(self, error: CannotAssemble) -> Exception:
        # The caller's 200 is on its way already: the body it cannot have is an error of its reading.
        return self._call.broken_stream(httpx.DecodingError(str(error)), self._received)

    def _broke(self, error: httpx.TransportError | httpx.DecodingError) -> None:
        """The stream broke (its response is closed): the leg ends with the error, whatever comes next."""
        self._migration.broke(time.perf_counter())
        self._tracker.cut()
        self._call.decode.end(self._call.decode.status, error)


class MigratingDecodeStream(_Body, DecodeStream):
    def __init__(self, response: httpx.Response, call: Call, migration: CallMigration, driver: SyncDriver) -> None:
        _Body.__init__(self, response, call, migration)
        self._driver = driver

    def __iter__(self) -> Iterator[bytes]:
        if self._drained:
            return
        tracker = self._tracker
        while True:
            chunks = iter(self._response.stream)  # type: ignore[arg-type]
            reads = 0  # of this response: a move starts a leg of its own
            try:
                for chunk in chunks:
                    self._received += len(chunk)
                    reads += 1
                    out = tracker.events(chunk)
                    if tracker.done:
                        # The answer is whole: read the body's end so the connection is reused.
                        out += [rest for rest in _until_error(chunks) if rest]
                        self._drained = True
                        self._call.decode_streamed(reads)
                    if sent := self._pass_on(out):
                        yield sent
                    if self._drained:
                        break
                else:
                    if rest := self._pass_on(tracker.end()):
                        yield rest
            except STREAM_ERRORS as exc:
                response = self._move(exc)
                if response is not None:
                    self._response = response
                    continue
                if ending := self._pass_on(self._migration.ending()):
                    yield ending
            except EventTooLarge as exc:
                yield self._too_large(exc)
                return
            if rest := self._end():
                yield rest
            return

    def _move(self, error: httpx.TransportError | httpx.DecodingError) -> httpx.Response | None:
        """Run the move's steps: a continuation's response, None (its answer had ended), or
        the openai error saying why it cannot move."""
        with contextlib.suppress(Exception):
            self._response.close()
        response: httpx.Response | None = self._driver.drive(self._moving(error))
        return response


class AsyncMigratingDecodeStream(_Body, AsyncDecodeStream):
    def __init__(self, response: httpx.Response, call: Call, migration: CallMigration, driver: AsyncDriver) -> None:
        _Body.__init__(self, response, call, migration)
        self._driver = driver

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._drained:
            return
        tracker = self._tracker
        while True:
            chunks = aiter(self._response.stream)  # type: ignore[arg-type]
            reads = 0  # of this response: a move starts a leg of its own
            try:
                async for chunk in chunks:
                    self._received += len(chunk)
                    reads += 1
                    out = tracker.events(chunk)
                    if tracker.done:
                        out += [rest async for rest in _until_error_async(chunks) if rest]
                        self._drained = True
                        self._call.decode_streamed(reads)
                    if sent := self._pass_on(out):
                        yield sent
                    if self._drained:
                        break
                else:
                    if rest := self._pass_on(tracker.end()):
                        yield rest
            except STREAM_ERRORS as exc:
                response = await self._move(exc)
                if response is not None:
                    self._response = response
                    continue
                if ending := self._pass_on(self._migration.ending()):
                    yield ending
            except EventTooLarge as exc:
                yield self._too_large(exc)
                return
            if rest := self._end():
                yield rest
            return

    async def _move(self, error: httpx.TransportError | httpx.DecodingError) -> httpx.Response | None:
        with contextlib.suppress(Exception):
            await self._response.aclose()
        response: httpx.Response | None = await self._driver.drive(self._moving(error))
        return response
