"""The decode's body on its way to the caller, chunk by chunk, never buffered: a flow of steps.

A body is a generator, as the call's flow (``_flow``) is: it yields ``Chunks`` (read this
response's body) and ``NEXT`` (its next chunk, None at its end), and the bytes for the
caller; a transport's stream (``transport._streams``) reads the chunks, hands the bytes on
and runs any other step with its driver. ``PlainBody`` tells the call when its first byte
arrives, turns a cut mid-way into the openai error callers already handle, and merges a
disaggregated call's ``usage`` on the way (``wire._usage.UsageMerge``: whole SSE events; a
JSON body once whole). ``MovingBody`` replaces it for a call that may move
(``migration``): it passes the caller whole SSE events, and when the decode stream breaks
(a reset, a server gone, a read timeout between chunks) it runs the move's steps
(``_move.move``: whether it may move, a continuation on another decode endpoint, through
a prefill endpoint first for a long prompt) and splices the continuation's events into
the same body. A stream that may not move raises the openai error with the reason; one cut
once its answer had ended does not move: it is ended as vLLM ends one.

A non-streamed call that may move streams its decode leg all the same; the events go into
an ``migration.Assembler`` instead of to the caller, who gets the JSON body at the end.
Observers see each continuation as another decode leg attempt (and its prefill, if any,
as another prefill attempt).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator
from typing import Any

import httpx

from ..migration import Assembler, CallMigration, CannotAssemble
from ..wire import EventTooLarge, ends_event_stream, stream_tail
from ._call import Call
from ._move import Move, move
from ._steps import NEXT, STREAM_ERRORS, Chunks, Close

Body = Generator[Any, Any, None]
"""A body's steps: ``Chunks``, ``NEXT`` and the other steps of ``_steps``, and bytes for the caller."""


def body_for(response: httpx.Response, call: Call, begun: Chunks | None = None) -> PlainBody | MovingBody:
    """The caller's body: a ``MovingBody`` if the call may move, else a ``PlainBody``.
    ``begun``: the response's read, if one began already (``Chunks``)."""
    start = begun or Chunks(response)
    migration = call.migration
    if migration is None or not migration.armed or response.status_code != 200:
        return PlainBody(response, call, start)
    if not response.headers.get("content-type", "").startswith("text/event-stream"):
        return PlainBody(response, call, start)
    if migration.assembles:
        # A non-streamed call gets JSON: the response's headers say so before the call reads
        # them (its usage merge is made for a JSON body, and the SDK parses what they name).
        response.headers["content-type"] = "application/json"
    return MovingBody(response, call, migration, start)


def _until_error() -> Generator[Any, Any, list[bytes]]:
    """The rest of a body whose answer is whole: a connection dropped from here on costs nothing."""
    rest: list[bytes] = []
    try:
        while (chunk := (yield NEXT)) is not None:
            rest.append(chunk)
    except STREAM_ERRORS:
        pass
    return rest


class PlainBody:
    """The decode body of a call that does not move."""

    def __init__(self, response: httpx.Response, call: Call, start: Chunks | None = None) -> None:
        self.response = response
        self.call = call
        self._start = start or Chunks(response)
        self.drained = False
        """Read to its end already (openai drains a stream again after [DONE])."""

    def steps(self) -> Body:
        if self.drained:
            return
        call = self.call
        received = reads = 0
        tail = b""
        yield self._start
        try:
            while (chunk := (yield NEXT)) is not None:
                if not received and chunk:
                    call.first_byte()
                received += len(chunk)
                reads += 1
                tail = stream_tail(tail, chunk)
                if ends_event_stream(tail):
                    # openai stops reading at [DONE] and closes; the body's end is right behind
                    # it, so read it now and the connection goes back to the pool for reuse.
                    chunk += b"".join((yield from _until_error()))
                    self.drained = True
                    call.decode.answered(reads)  # its endpoint learns the time per read, ~a step
                if out := call.caller_body.feed(chunk):
                    yield out
            held = call.caller_body.rest()
        except STREAM_ERRORS as exc:
            raise call.broken_stream(exc, received) from exc
        except EventTooLarge as exc:
            held = call.event_too_large(exc, received)
        self.drained = True
        if held:
            yield held


class MovingBody:
    """The decode body of an armed call: whole SSE events passed on (``migration.Tracker``), or
    assembled into a JSON body; when the decode stream breaks, the move's steps
    (``_move.move``), and the continuation's events spliced into the same body."""

    def __init__(
        self, response: httpx.Response, call: Call, migration: CallMigration, start: Chunks | None = None
    ) -> None:
        self.response = response
        self.call = call
        self._start = start or Chunks(response)
        self._migration = migration
        assert migration.tracker is not None
        self._tracker = migration.tracker
        self._assembler = (
            Assembler(chat=self._tracker.chat, keep_ids=migration.caller_wants_ids) if migration.assembles else None
        )
        self._received = 0
        self._first = True
        self.drained = False

    def steps(self) -> Body:
        if self.drained:
            return
        tracker = self._tracker
        start = self._start
        while True:
            yield start
            reads = 0  # of this response: a move starts a leg of its own
            try:
                while (chunk := (yield NEXT)) is not None:
                    self._received += len(chunk)
                    reads += 1
                    if reads == 1:  # this response's answer has begun, a moved stream's continuation too
                        self.call.decode.streaming()
                    out = tracker.events(chunk)
                    if tracker.done:
                        # The answer is whole: read the body's end so the connection is reused.
                        out += [rest for rest in (yield from _until_error()) if rest]
                        self.drained = True
                        self.call.decode.answered(reads)
                    if sent := self._pass_on(out):
                        yield sent
                    if self.drained:
                        break
                else:
                    if rest := self._pass_on(tracker.end()):
                        yield rest
            except STREAM_ERRORS as exc:
                response = yield from self._move(exc)
                if response is not None:
                    self.response, start = response, Chunks(response)
                    continue
                if ending := self._pass_on(self._migration.ending()):
                    yield ending
            except EventTooLarge as exc:
                yield self._too_large(exc)
                return
            if rest := self._end():
                yield rest
            return

    def _move(self, error: httpx.TransportError | httpx.DecodingError) -> Move:
        """The move's steps, once the broken response is closed: a continuation's response,
        None (its answer had ended), or the openai error saying why it cannot move."""
        with contextlib.suppress(Exception):  # a broken response's close may fail too: it is gone either way
            yield Close(self.response)
        self._broke(error)
        return (yield from move(self.call, self._migration, error, self._received))

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
            self.call.first_byte()
        return self.call.caller_body.events(events)

    def _end(self) -> bytes:
        """The body's last bytes, once the decode's events are over: the assembled body, and
        what the usage merge still holds."""
        self.drained = True
        out = b""
        if self._assembler is not None:
            try:
                body = self._assembler.body(self._migration.usage())
            except CannotAssemble as exc:
                raise self._unassembled(exc) from None
            self.call.first_byte()
            out = self.call.caller_body.feed(body)
        return out + self.call.caller_body.rest()

    def _too_large(self, error: EventTooLarge) -> bytes:
        """The end of a body whose decode sent an event longer than pdclient handles whole."""
        self.drained = True
        self._tracker.cut()
        if self._assembler is not None:
            raise self._unassembled(CannotAssemble(str(error)))
        return self.call.event_too_large(error, self._received)

    def _unassembled(self, error: CannotAssemble) -> Exception:
        # The caller's 200 is on its way already: the body it cannot have is an error of its reading.
        return self.call.broken_stream(httpx.DecodingError(str(error)), self._received)

    def _broke(self, error: httpx.TransportError | httpx.DecodingError) -> None:
        """The stream broke (its response is closed): the leg ends with the error, whatever comes next."""
        self._migration.broke(time.perf_counter())
        self._tracker.cut()
        self.call.decode.end(self.call.decode.status, error)


__all__ = ["Body", "MovingBody", "PlainBody", "body_for"]
