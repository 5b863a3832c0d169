"""The caller's response body: a decode body's steps (``handoff.PlainBody``,
``handoff.MovingBody``) run as an httpx byte stream.

The body decides; a stream reads the chunks it asks for (``Chunks``, ``NEXT``), hands its
bytes to the caller, and runs any other step (a move's legs) with its transport's driver.
Closing it closes the decode's response and ends the call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any

import httpx

from ..handoff import NEXT, Chunks, MovingBody, PlainBody

if TYPE_CHECKING:
    from ._drivers import AsyncDriver, SyncDriver


class DecodeStream(httpx.SyncByteStream):
    def __init__(self, body: PlainBody | MovingBody, driver: SyncDriver) -> None:
        self._body = body
        self._driver = driver
        self._closed = False

    def __iter__(self) -> Iterator[bytes]:
        if self._body.drained:
            return
        steps = self._body.steps()
        chunks: Iterator[bytes] = iter(())
        result: Any = None
        failure: BaseException | None = None
        while True:
            try:
                step = steps.send(result) if failure is None else steps.throw(failure)
            except StopIteration:
                return
            result = failure = None
            if type(step) is bytes:
                yield step
                continue
            try:
                if step is NEXT:
                    result = next(chunks, None)
                elif type(step) is Chunks:
                    chunks = iter(step.response.stream)  # type: ignore[arg-type]
                else:
                    result = self._driver.run(step)
            except BaseException as exc:
                failure = exc

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._body.response.close()
        finally:
            self._body.call.decode_closed()


class AsyncDecodeStream(httpx.AsyncByteStream):
    def __init__(self, body: PlainBody | MovingBody, driver: AsyncDriver) -> None:
        self._body = body
        self._driver = driver
        self._closed = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self._body.drained:
            return
        steps = self._body.steps()
        chunks: AsyncIterator[bytes] | None = None
        result: Any = None
        failure: BaseException | None = None
        while True:
            try:
                step = steps.send(result) if failure is None else steps.throw(failure)
            except StopIteration:
                return
            result = failure = None
            if type(step) is bytes:
                yield step
                continue
            try:
                if step is NEXT:
                    assert chunks is not None
                    result = await anext(chunks, None)
                elif type(step) is Chunks:
                    chunks = aiter(step.response.stream)  # type: ignore[arg-type]
                else:
                    result = await self._driver.run(step)
            except BaseException as exc:
                failure = exc

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._body.response.aclose()
        finally:
            self._body.call.decode_closed()


__all__ = ["AsyncDecodeStream", "DecodeStream"]
