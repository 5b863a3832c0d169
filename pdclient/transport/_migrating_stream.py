"""The decode body of an armed call (``migration._core``): tracked, and moved when it breaks.

``MigratingDecodeStream`` replaces ``transport._streams.DecodeStream`` for a call that may move. It
passes the caller whole SSE events (``migration._core.Tracker``); when the decode stream breaks
(a reset, a server gone, a read timeout between chunks) it asks the call whether it may
move, opens a continuation on another decode endpoint (through a prefill endpoint first
for a long prompt, ``migration._core.continuation_route``) and splices its events into the same
body. A stream that may not move raises the openai error of ``transport._streams`` with the reason.
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

from ..handoff import Call, Leg
from ..migration import Assembler, CallMigration, CannotAssemble, CannotMove, Continuation, Route
from ..pools import AllEndpointsOpen
from ..routing import RouteRequest
from ._streams import _STREAM_ERRORS, AsyncDecodeStream, DecodeStream, _until_error, _until_error_async

if TYPE_CHECKING:
    from ._transport import AsyncPDTransport, PDTransport

_ERROR_TEXT = 300


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


def decode_stream(response: httpx.Response, call: Call, transport: PDTransport) -> httpx.SyncByteStream:
    """The caller's body: a ``MigratingDecodeStream`` if the call may move, else a plain ``DecodeStream``."""
    migration = _movable(response, call)
    if migration is None:
        return DecodeStream(response, call)
    _answers_json(response, migration)
    return MigratingDecodeStream(response, call, migration, transport)


def async_decode_stream(response: httpx.Response, call: Call, transport: AsyncPDTransport) -> httpx.AsyncByteStream:
    migration = _movable(response, call)
    if migration is None:
        return AsyncDecodeStream(response, call)
    _answers_json(response, migration)
    return AsyncMigratingDecodeStream(response, call, migration, transport)


def _cause(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".rstrip(": ")


def _release_leg(call: Call, migration: CallMigration, continuation: Continuation) -> tuple[Leg, httpx.Request] | None:
    """A one-token decode that frees a continuation prefill's KV when its decode never went out."""
    content = migration.release_body(continuation)
    if content is None:
        return None
    leg = Leg(call, "release", call.context.fleet.decode)
    try:
        plan = migration.plan
        base = leg.pick(RouteRequest(leg="decode", affinity_key=plan.affinity_key, tenant=plan.tenant))
    except AllEndpointsOpen:
        return None
    request = call._leg_request(base, content, call._sign(base, content))
    request.headers["x-request-id"] = continuation.request_id
    return leg, leg.start(request)


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

    def _pass_on(self, out: bytes) -> bytes:
        """Events the tracker passed on: the caller's now (a stream), or the body's (assembled)."""
        if not out:
            return b""
        self._migration.delivered(time.perf_counter())
        if self._assembler is not None:
            try:
                self._assembler.feed(out)
            except CannotAssemble as exc:
                raise self._unassembled(exc) from None
            return b""
        if self._first:
            self._first = False
            self._call.first_byte()
        return self._call.to_caller(out)

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
            out = self._call.to_caller(body)
        return out + self._call.caller_rest()

    def _unassembled(self, error: CannotAssemble) -> Exception:
        # The caller's 200 is on its way already: the body it cannot have is an error of its reading.
        return self._call.broken_stream(httpx.DecodingError(str(error)), self._received)

    def _broke(self, error: httpx.TransportError | httpx.DecodingError) -> None:
        """The stream broke (its response is closed): the leg ends with the error, whatever comes next."""
        self._migration.broke(time.perf_counter())
        self._tracker.cut()
        self._call.decode.end(self._call.decode.status, error)


class MigratingDecodeStream(_Body, httpx.SyncByteStream):
    def __init__(self, response: httpx.Response, call: Call, migration: CallMigration, transport: PDTransport) -> None:
        super().__init__(response, call, migration)
        self._transport = transport

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
                    out = tracker.feed(chunk)
                    if tracker.done:
                        # The answer is whole: read the body's end so the connection is reused.
                        for rest in _until_error(chunks):
                            out += rest
                        self._drained = True
                        self._call.decode_streamed(reads)
                    if out := self._pass_on(out):
                        yield out
                    if self._drained:
                        break
                else:
                    if rest := self._pass_on(tracker.end()):
                        yield rest
            except _STREAM_ERRORS as exc:
                response = self._move(exc)
                if response is not None:
                    self._response = response
                    continue
                if ending := self._pass_on(self._migration.ending()):
                    yield ending
            if rest := self._end():
                yield rest
            return

    def _move(self, error: httpx.TransportError | httpx.DecodingError) -> httpx.Response | None:
        """Open a continuation of the broken stream (None: its answer had ended), or raise the
        openai error saying why not."""
        call, migration, received = self._call, self._migration, self._received
        with contextlib.suppress(Exception):
            self._response.close()
        self._broke(error)
        if self._tracker.answered:
            return None  # every choice had finished: nothing to continue, and nothing lost
        reason = migration.why_not(call)
        if reason is not None:
            raise call.broken_stream(error, received, reason) from error
        try:
            continuation = migration.begin(call, _cause(error))
            if continuation.route is Route.PREFILL_DECODE:
                self._prefill(continuation)
            return self._open(continuation)
        except (CannotMove, AllEndpointsOpen, *_STREAM_ERRORS) as failed:
            raise call.broken_stream(error, received, f"the continuation failed: {_cause(failed)}") from error

    def _prefill(self, continuation: Continuation) -> None:
        call, migration = self._call, self._migration
        try:
            request = migration.prefill_request(call, continuation)
        except AllEndpointsOpen as exc:
            continuation.route, continuation.note = Route.DECODE, f"no prefill endpoint: {exc}"
            return
        try:
            response = self._transport._read(request)
        except Exception as exc:
            call.prefill.end(None, exc)
            continuation.route, continuation.note = Route.DECODE, f"its prefill failed: {_cause(exc)}"
            return
        call.prefill.end(response.status_code, None)
        migration.read_prefill(continuation, response)

    def _open(self, continuation: Continuation) -> httpx.Response:
        call, migration = self._call, self._migration
        migration.pending = continuation
        call.decode_may_have_reached = False
        try:
            response = self._transport._open_decode(call)
        except BaseException:
            if not call.decode_may_have_reached:
                self._release(continuation)
            raise
        finally:
            migration.pending = None
        call.decode.status = response.status_code
        if response.status_code != 200 or not response.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                text = response.read()[:_ERROR_TEXT].decode("utf-8", "replace")
            finally:
                response.close()
            call.decode.end(response.status_code, None)
            raise CannotMove(f"{call.decode.url} answered HTTP {response.status_code}: {text}")
        migration.moved(call, continuation)
        return response

    def _release(self, continuation: Continuation) -> None:
        self._transport._send_release(_release_leg(self._call, self._migration, continuation))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._response.close()
        finally:
            self._call.decode_closed()


class AsyncMigratingDecodeStream(_Body, httpx.AsyncByteStream):
    def __init__(
        self, response: httpx.Response, call: Call, migration: CallMigration, transport: AsyncPDTransport
    ) -> None:
        super().__init__(response, call, migration)
        self._transport = transport

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
                    out = tracker.feed(chunk)
                    if tracker.done:
                        async for rest in _until_error_async(chunks):
                            out += rest
                        self._drained = True
                        self._call.decode_streamed(reads)
                    if out := self._pass_on(out):
                        yield out
                    if self._drained:
                        break
                else:
                    if rest := self._pass_on(tracker.end()):
                        yield rest
            except _STREAM_ERRORS as exc:
                response = await self._move(exc)
                if response is not None:
                    self._response = response
                    continue
                if ending := self._pass_on(self._migration.ending()):
                    yield ending
            if rest := self._end():
                yield rest
            return

    async def _move(self, error: httpx.TransportError | httpx.DecodingError) -> httpx.Response | None:
        call, migration, received = self._call, self._migration, self._received
        with contextlib.suppress(Exception):
            await self._response.aclose()
        self._broke(error)
        if self._tracker.answered:
            return None  # every choice had finished: nothing to continue, and nothing lost
        reason = migration.why_not(call)
        if reason is not None:
            raise call.broken_stream(error, received, reason) from error
        try:
            continuation = migration.begin(call, _cause(error))
            if continuation.route is Route.PREFILL_DECODE:
                await self._prefill(continuation)
            return await self._open(continuation)
        except (CannotMove, AllEndpointsOpen, *_STREAM_ERRORS) as failed:
            raise call.broken_stream(error, received, f"the continuation failed: {_cause(failed)}") from error

    async def _prefill(self, continuation: Continuation) -> None:
        call, migration = self._call, self._migration
        try:
            request = migration.prefill_request(call, continuation)
        except AllEndpointsOpen as exc:
            continuation.route, continuation.note = Route.DECODE, f"no prefill endpoint: {exc}"
            return
        try:
            response = await self._transport._read(request)
        except Exception as exc:
            call.prefill.end(None, exc)
            continuation.route, continuation.note = Route.DECODE, f"its prefill failed: {_cause(exc)}"
            return
        call.prefill.end(response.status_code, None)
        migration.read_prefill(continuation, response)

    async def _open(self, continuation: Continuation) -> httpx.Response:
        call, migration = self._call, self._migration
        migration.pending = continuation
        call.decode_may_have_reached = False
        try:
            response = await self._transport._open_decode(call)
        except BaseException:
            if not call.decode_may_have_reached:
                await self._release(continuation)
            raise
        finally:
            migration.pending = None
        call.decode.status = response.status_code
        if response.status_code != 200 or not response.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                text = (await response.aread())[:_ERROR_TEXT].decode("utf-8", "replace")
            finally:
                await response.aclose()
            call.decode.end(response.status_code, None)
            raise CannotMove(f"{call.decode.url} answered HTTP {response.status_code}: {text}")
        migration.moved(call, continuation)
        return response

    async def _release(self, continuation: Continuation) -> None:
        await self._transport._send_release(_release_leg(self._call, self._migration, continuation))

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._response.aclose()
        finally:
            self._call.decode_closed()
