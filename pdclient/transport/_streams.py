"""The decode's body on its way to the caller, chunk by chunk, never buffered.

The stream tells the call when its first byte arrives, turns a cut mid-way into the
openai error callers already handle, and ends the call when the caller closes it. A
disaggregated call's ``usage`` is merged on the way (``wire._usage.UsageMerge``: whole SSE
events; a JSON body once whole). The sync and async twins differ only by ``await``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx

from ..handoff import STREAM_ERRORS, Call
from ..wire import EventTooLarge, ends_event_stream, stream_tail


class DecodeStream(httpx.SyncByteStream):
    def __init__(self, response: httpx.Response, call: Call) -> None:
        self._response = response
        self._call = call
        self._closed = False
        self._drained = False

    def __iter__(self) -> Iterator[bytes]:
        if self._drained:
            return  # read to its end already (openai drains a stream again after [DONE])
        received = reads = 0
        tail = b""
        chunks = iter(self._response.stream)  # type: ignore[arg-type]
        try:
            for chunk in chunks:
                if not received and chunk:
                    self._call.first_byte()
                received += len(chunk)
                reads += 1
                tail = stream_tail(tail, chunk)
                if ends_event_stream(tail):
                    # openai stops reading at [DONE] and closes; the body's end is right behind
                    # it, so read it now and the connection goes back to the pool for reuse.
                    # The answer is whole: a connection dropped from here on costs nothing.
                    for rest in _until_error(chunks):
                        chunk += rest
                    self._drained = True
                    self._call.decode_streamed(reads)
                if out := self._call.caller_body.feed(chunk):
                    yield out
            held = self._call.caller_body.rest()
        except STREAM_ERRORS as exc:
            raise self._call.broken_stream(exc, received) from exc
        except EventTooLarge as exc:
            held = self._call.event_too_large(exc, received)
        self._drained = True
        if held:
            yield held

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._response.close()
        finally:
            self._call.decode_closed()


class AsyncDecodeStream(httpx.AsyncByteStream):
    def __init__(self, response: httpx.Response, call: Call) -> None:
        self._response = response
        self._call = call
        self._closed = False
        self._drained = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._drained:
            return
        received = reads = 0
        tail = b""
        chunks = aiter(self._response.stream)  # type: ignore[arg-type]
        try:
            async for chunk in chunks:
                if not received and chunk:
                    self._call.first_byte()
                received += len(chunk)
                reads += 1
                tail = stream_tail(tail, chunk)
                if ends_event_stream(tail):
                    async for rest in _until_error_async(chunks):
                        chunk += rest
                    self._drained = True
                    self._call.decode_streamed(reads)
                if out := self._call.caller_body.feed(chunk):
                    yield out
            held = self._call.caller_body.rest()
        except STREAM_ERRORS as exc:
            raise self._call.broken_stream(exc, received) from exc
        except EventTooLarge as exc:
            held = self._call.event_too_large(exc, received)
        self._drained = True
        if held:
            yield held

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._response.aclose()
        finally:
            self._call.decode_closed()


def _until_error(chunks: Iterator[bytes]) -> Iterator[bytes]:
    try:
        yield from chunks
    except STREAM_ERRORS:
        return


async def _until_error_async(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield chunk
    except STREAM_ERRORS:
        return
