"""The caller's response body: a decode body's steps (``handoff.PlainBody``,
``handoff.MovingBody``) run as an httpx byte stream.

The body decides; its transport's driver runs its steps (``steps_of``: the chunks it asks
for, a move's legs) and the stream hands the body's bytes to the caller. Closing it
closes the decode's response and ends the call.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import TYPE_CHECKING, Any, cast

import httpx

from ..handoff import MovingBody, PlainBody, steps
from ._relay import Deliver

if TYPE_CHECKING:
    from ._drivers import AsyncDriver, SyncDriver


class _BodyStream:
    """What both streams share: the body's steps run by the driver, and one close that ends the call."""

    def __init__(self, body: PlainBody | MovingBody, driver: SyncDriver | AsyncDriver) -> None:
        self._body = body
        self._driver = driver
        self._closed = False

    def _chunks(self) -> Any:
        return self._driver.steps_of(steps.FlowRun(self._body.steps()))

    @contextlib.contextmanager
    def _closing(self) -> Iterator[bool]:
        """Whether this is the stream's first close; after that one the call ends, whatever it raised."""
        first, self._closed = not self._closed, True
        try:
            yield first
        finally:
            if first:
                self._body.call.decode_closed()


class DecodeStream(_BodyStream, httpx.SyncByteStream):
    def __iter__(self) -> Iterator[bytes]:
        return self._chunks()  # type: ignore[no-any-return]

    def close(self) -> None:
        with self._closing() as first:
            if first:
                self._body.response.close()


class AsyncDecodeStream(_BodyStream, httpx.AsyncByteStream):
    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()  # type: ignore[no-any-return]

    def relayed(self, deliver: Deliver) -> AsyncIterator[bytes]:
        """The body's bytes, those its leg's reader can push given to ``deliver`` as they
        arrive (``transport._relay``), the rest yielded as by iterating the stream."""
        driver = cast("AsyncDriver", self._driver)  # the async stream's, as ``_chunks`` has it
        return driver.steps_of(steps.FlowRun(self._body.steps()), deliver)

    async def aclose(self) -> None:
        with self._closing() as first:
            if first:
                await self._body.response.aclose()


__all__ = ["AsyncDecodeStream", "DecodeStream"]
