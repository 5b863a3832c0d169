"""The caller's response body: a decode body's steps (``handoff.PlainBody``,
``handoff.MovingBody``) run as an httpx byte stream.

The body decides; a stream reads the chunks it asks for (``Chunks``, ``NEXT``), hands its
bytes to the caller, and runs any other step (a move's legs) with its transport's driver.
Closing it closes the decode's response and ends the call.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING

import httpx

from ..handoff import MovingBody, PlainBody, steps

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
        run = steps.FlowRun(self._body.steps())
        chunks: Iterator[bytes] = iter(())
        for step in run:
            if type(step) is bytes:
                yield step
                continue
            with run:
                if step is steps.NEXT:
                    run.result = next(chunks, None)
                elif type(step) is steps.Chunks:
                    chunks = iter(step.response.stream)  # type: ignore[arg-type]
                else:
                    run.result = self._driver.run(step)

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
        run = steps.FlowRun(self._body.steps())
        chunks: AsyncIterator[bytes] | None = None
        for step in run:
            if type(step) is bytes:
                yield step
                continue
            with run:
                if step is steps.NEXT:
                    assert chunks is not None
                    run.result = await anext(chunks, None)
                elif type(step) is steps.Chunks:
                    chunks = aiter(step.response.stream)  # type: ignore[arg-type]
                else:
                    run.result = await self._driver.run(step)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self._body.response.aclose()
        finally:
            self._body.call.decode_closed()


__all__ = ["AsyncDecodeStream", "DecodeStream"]
