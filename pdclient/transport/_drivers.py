"""The two drivers of a call's flow (``handoff.call_flow``, ``handoff.move``): they run its
steps (``handoff.steps``) with blocking calls or with ``await``, and decide nothing.

Each driver sends the flow a step's result, or throws the step's exception into it, until
the flow returns. What only the async driver does is written here once, as a rule of its
own: a ``Release`` and a ``Discard`` are shielded from the caller's cancel; a prefill read
with ``outlive`` goes on in a task of its own if its caller leaves (``_read_to_the_end``);
a ``Concurrently`` runs its decode in a task group around the steps that run meanwhile.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Generator
from typing import Any, TypeVar

import anyio
import httpx

from ..fleet import running_library
from ..handoff import body_for, open_decode, steps
from ._concurrent import AsyncDecodeInFlight, AsyncReplayed, DecodeInFlight, Replayed
from ._leg_client import AsyncLegClient, LegClient
from ._streams import AsyncDecodeStream, DecodeStream

T = TypeVar("T")


class SyncDriver:
    """Runs a flow's steps in the caller's thread (a concurrent decode in a thread of its own)."""

    def __init__(self, legs: LegClient) -> None:
        self.legs = legs

    def drive(self, flow: Generator[Any, Any, T]) -> T:
        run = steps.FlowRun(flow)
        for step in run:
            with run:
                run.result = _SYNC[type(step)](self, step)
        return run.value

    def run(self, step: Any) -> Any:
        """One step's result (a decode body's steps other than its reads)."""
        return _SYNC[type(step)](self, step)

    def read(self, request: httpx.Request) -> httpx.Response:
        """A leg's response, its body read and its connection back in the pool."""
        response = self.legs.send(request)
        try:
            response.read()
        finally:
            response.close()
        return response

    def _open(self, step: steps.Open) -> httpx.Response:
        watch = step.watch
        step.request.extensions["trace"] = lambda event, info: watch(event)
        return self.legs.send(step.request)

    def _release(self, step: steps.Release) -> None:
        try:
            response = self.read(step.request)
            step.leg.end(response.status_code, None)
        except Exception as exc:
            step.leg.end(None, exc)

    def _concurrently(self, step: steps.Concurrently) -> Any:
        step.sent.in_flight = DecodeInFlight(self.legs.fresh_connections(), step.sent.request, step.watch)
        return self.drive(step.during())

    def _peek(self, step: steps.PeekFirstEvent) -> None:
        stream = step.response.stream
        assert isinstance(stream, httpx.SyncByteStream)
        chunks = iter(stream)
        read: list[bytes] = []
        for chunk in chunks:
            read.append(chunk)
            if step.peek.feed(chunk):
                break
        step.response.stream = Replayed(read, chunks, stream)

    def _read_refusal(self, step: steps.ReadRefusal) -> bytes:
        try:
            return step.response.read()
        finally:
            step.response.close()


_SYNC: dict[type, Callable[[SyncDriver, Any], Any]] = {
    steps.ReadRequest: lambda driver, step: step.request.read(),
    steps.SendPrefill: lambda driver, step: driver.read(step.request),
    steps.Open: SyncDriver._open,
    steps.OpenDecode: lambda driver, step: driver.drive(open_decode(step.call)),
    steps.Stream: lambda driver, step: DecodeStream(body_for(step.response, step.call), driver),
    steps.Close: lambda driver, step: step.response.close(),
    steps.Release: SyncDriver._release,
    steps.Sleep: lambda driver, step: time.sleep(step.seconds),
    steps.Concurrently: SyncDriver._concurrently,
    steps.Await: lambda driver, step: step.sent.in_flight.result(),
    steps.Cut: lambda driver, step: step.sent.in_flight.cancel(),
    steps.Discard: lambda driver, step: step.sent.in_flight.discard(),
    steps.PeekFirstEvent: SyncDriver._peek,
    steps.ReadRefusal: SyncDriver._read_refusal,
}


class AsyncDriver:
    """Runs a flow's steps with ``await`` (asyncio and trio)."""

    def __init__(self, legs: AsyncLegClient) -> None:
        self.legs = legs
        self._outliving: set[asyncio.Future[httpx.Response]] = set()
        """Concurrent calls' prefills whose callers left before they answered (``_read_to_the_end``),
        on ``legs``' connections: the transport's copies share this driver, as they share the
        connections, so whichever closes them first waits for every such prefill."""

    async def drive(self, flow: Generator[Any, Any, T]) -> T:
        run = steps.FlowRun(flow)
        for step in run:
            with run:
                run.result = await _ASYNC[type(step)](self, step)
        return run.value

    async def run(self, step: Any) -> Any:
        return await _ASYNC[type(step)](self, step)

    async def read(self, request: httpx.Request) -> httpx.Response:
        response = await self.legs.send(request)
        try:
            await response.aread()
        finally:
            await response.aclose()
        return response

    async def _send_prefill(self, step: steps.SendPrefill) -> httpx.Response:
        return await (self._read_to_the_end(step.request) if step.outlive else self.read(step.request))

    async def _read_to_the_end(self, request: httpx.Request) -> httpx.Response:
        """A concurrent call's prefill, read to its end even if the caller leaves meanwhile.

        The decode sent with it has registered its blocks with the prefill server, and vLLM
        0.32 frees the blocks of an aborted push-mode decode only once a WRITE lands (vLLM
        issue #46283): a prefill cut with its caller would leave them held for good. So the
        caller's cancel ends the decode and returns at once, and the prefill goes on in a
        task of its own until its server answers; its WRITE then frees the decode's blocks.
        Under trio no task outlives its caller's nursery: the prefill is read as any leg.
        """
        if running_library() != "asyncio":
            return await self.read(request)
        task = asyncio.ensure_future(self.read(request))
        self._outliving.add(task)
        task.add_done_callback(self._outlived)
        return await asyncio.shield(task)

    def _outlived(self, task: asyncio.Future[httpx.Response]) -> None:
        self._outliving.discard(task)
        if not task.cancelled():
            task.exception()  # its caller, if it left, no longer reads it: retrieved here

    async def outlived(self, seconds: float | None) -> None:
        """Wait, ``seconds`` (the prefill phase's bound) at most, for the prefills that outlive their
        callers: closing the legs' connections would abort them, and with them the WRITE that
        frees their decodes' blocks."""
        if self._outliving:
            await asyncio.wait(set(self._outliving), timeout=seconds)

    async def _open(self, step: steps.Open) -> httpx.Response:
        watch = step.watch

        async def trace(event: str, info: object) -> None:
            watch(event)

        step.request.extensions["trace"] = trace
        return await self.legs.send(step.request)

    async def _release(self, step: steps.Release) -> None:
        with anyio.CancelScope(shield=True):  # a cancelled caller still frees the blocks
            try:
                response = await self.read(step.request)
                step.leg.end(response.status_code, None)
            except Exception as exc:
                step.leg.end(None, exc)

    async def _concurrently(self, step: steps.Concurrently) -> Any:
        decode = step.sent.in_flight = AsyncDecodeInFlight(self.legs, step.sent.request, step.watch)
        async with anyio.create_task_group() as legs:
            legs.start_soon(decode.run)
            try:
                return await self.drive(step.during())
            except BaseException:
                decode.cancel()
                raise

    async def _peek(self, step: steps.PeekFirstEvent) -> None:
        stream = step.response.stream
        assert isinstance(stream, httpx.AsyncByteStream)
        chunks = aiter(stream)
        read: list[bytes] = []
        async for chunk in chunks:
            read.append(chunk)
            if step.peek.feed(chunk):
                break
        step.response.stream = AsyncReplayed(read, chunks, stream)

    async def _read_refusal(self, step: steps.ReadRefusal) -> bytes:
        try:
            return await step.response.aread()
        finally:
            await step.response.aclose()


async def _now(value: T) -> T:
    return value


_ASYNC: dict[type, Callable[[AsyncDriver, Any], Coroutine[Any, Any, Any]]] = {
    steps.ReadRequest: lambda driver, step: step.request.aread(),
    steps.SendPrefill: AsyncDriver._send_prefill,
    steps.Open: AsyncDriver._open,
    steps.OpenDecode: lambda driver, step: driver.drive(open_decode(step.call)),
    steps.Stream: lambda driver, step: _now(AsyncDecodeStream(body_for(step.response, step.call), driver)),
    steps.Close: lambda driver, step: step.response.aclose(),
    steps.Release: AsyncDriver._release,
    steps.Sleep: lambda driver, step: anyio.sleep(step.seconds),
    steps.Concurrently: AsyncDriver._concurrently,
    steps.Await: lambda driver, step: _now(step.sent.in_flight.result()),
    steps.Cut: lambda driver, step: _now(step.sent.in_flight.cancel()),
    steps.Discard: lambda driver, step: step.sent.in_flight.discard(),
    steps.PeekFirstEvent: AsyncDriver._peek,
    steps.ReadRefusal: AsyncDriver._read_refusal,
}

__all__ = ["AsyncDriver", "SyncDriver"]
