"""The two drivers of a call's flow (``handoff.call_flow``, ``handoff.move``): they run its
steps (``handoff.steps``) with blocking calls or with ``await``, and decide nothing.

Each driver sends the flow a step's result, or throws the step's exception into it, until
the flow returns; one table (``_HANDLERS``) names the method that runs each step, and
their base holds the steps both run by the same call on a handle. What only the async
driver does is a rule of its own, written once: a ``Release`` and a ``Discard`` are
shielded from the caller's cancel; a prefill read with ``outlive`` goes on in a task of
its own if its caller leaves (``_outliving``); a ``Concurrently`` runs its decode in a
task group around the steps that run meanwhile.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Callable, Generator, Iterator
from typing import Any, ClassVar, Generic, TypeVar

import anyio
import httpx

from ..handoff import MovingBody, PlainBody, body_for, open_decode, steps
from ._concurrent import AsyncDecodeInFlight, DecodeInFlight, async_trace
from ._leg_client import AsyncLegClient, LegClient
from ._outliving import Outliving
from ._relay import READ, Deliver, Relay, Relayed, settled
from ._streams import AsyncDecodeStream, DecodeStream

T = TypeVar("T")
L = TypeVar("L", LegClient, AsyncLegClient)

_HANDLERS: dict[type, str] = {
    steps.ReadRequest: "read_request",
    steps.SendPrefill: "send_prefill",
    steps.Open: "open",
    steps.OpenDecode: "open_decode",
    steps.Stream: "stream",
    steps.Close: "close",
    steps.Release: "release",
    steps.Sleep: "sleep",
    steps.Concurrently: "concurrently",
    steps.Await: "await_decode",
    steps.Cut: "cut",
    steps.Discard: "discard",
    steps.ReadRefusal: "read_refusal",
}
"""The driver method that runs each step: one table, each driver's methods of these names."""


class _Driver(Generic[L]):
    """What both drivers share: their legs, how a step finds its method, and the steps run by
    the same call on both (blocking on one, awaitable on the other: the handles' and
    ``drive``'s own kind)."""

    _steps: ClassVar[dict[type, Callable[[Any, Any], Any]]]

    def __init__(self, legs: L) -> None:
        self.legs: L = legs

    def __init_subclass__(cls) -> None:
        cls._steps = {step: getattr(cls, name) for step, name in _HANDLERS.items()}

    def run(self, step: Any) -> Any:
        """One step's result (a decode body's steps other than its reads); awaitable on async."""
        return self._steps[type(step)](self, step)

    def drive(self, flow: Generator[Any, Any, T]) -> Any: ...

    def open_decode(self, step: steps.OpenDecode) -> Any:
        return self.drive(open_decode(step.call))

    def await_decode(self, step: steps.Await) -> Any:
        return step.sent.in_flight.outcome()

    def cut(self, step: steps.Cut) -> Any:
        return step.sent.in_flight.cut()

    def discard(self, step: steps.Discard) -> Any:
        return step.sent.in_flight.discard()

    def _body(self, step: steps.Stream) -> PlainBody | MovingBody:
        return body_for(step.response, step.call, step.begun)


class SyncDriver(_Driver[LegClient]):
    """Runs a flow's steps in the caller's thread (a concurrent decode in a thread of its own)."""

    def drive(self, flow: Generator[Any, Any, T]) -> T:
        run = steps.FlowRun(flow)
        for _ in self.steps_of(run):
            pass
        return run.value

    def steps_of(self, run: steps.FlowRun[Any]) -> Iterator[bytes]:
        """Runs a flow's steps; a body's (``Chunks``, ``NEXT``) read here, its bytes yielded."""
        chunks: Iterator[bytes] = iter(())
        for step in run:
            if type(step) is bytes:
                yield step
                continue
            with run:
                if step is steps.NEXT:
                    run.result = next(chunks, None)
                elif type(step) is steps.Chunks:
                    stream = step.response.stream if step.rest is None else itertools.chain(step.read, step.rest)
                    run.result = chunks = iter(stream)  # type: ignore[arg-type]
                else:
                    run.result = self._steps[type(step)](self, step)

    def read(self, request: httpx.Request) -> httpx.Response:
        """A leg's response, its body read and its connection back in the pool."""
        return self._read_all(self.legs.send(request))

    def _read_all(self, response: httpx.Response) -> httpx.Response:
        try:
            response.read()
        finally:
            response.close()
        return response

    def read_request(self, step: steps.ReadRequest) -> bytes:
        return step.request.read()

    def send_prefill(self, step: steps.SendPrefill) -> httpx.Response:
        return self.read(step.request)

    def read_refusal(self, step: steps.ReadRefusal) -> bytes:
        return self._read_all(step.response).content

    def open(self, step: steps.Open) -> httpx.Response:
        watch = step.watch
        step.request.extensions["trace"] = lambda event, info: watch(event)
        return self.legs.send(step.request)

    def stream(self, step: steps.Stream) -> DecodeStream:
        return DecodeStream(self._body(step), self)

    def close(self, step: steps.Close) -> None:
        step.response.close()

    def sleep(self, step: steps.Sleep) -> None:
        time.sleep(step.seconds)

    def release(self, step: steps.Release) -> None:
        try:
            step.leg.end(self.read(step.request).status_code, None)
        except Exception as exc:
            step.leg.end(None, exc)

    def concurrently(self, step: steps.Concurrently) -> Any:
        step.sent.in_flight = DecodeInFlight(self.legs.fresh_connections(), step.sent.request, step.watch)
        return self.drive(step.during())


class AsyncDriver(_Driver[AsyncLegClient]):
    """Runs a flow's steps with ``await`` (asyncio and trio)."""

    def __init__(self, legs: AsyncLegClient) -> None:
        super().__init__(legs)
        self.outliving = Outliving()

    async def drive(self, flow: Generator[Any, Any, T]) -> T:
        run = steps.FlowRun(flow)
        async for _ in self.steps_of(run):
            pass
        return run.value

    async def steps_of(self, run: steps.FlowRun[Any], deliver: Deliver | None = None) -> AsyncIterator[bytes]:
        """With ``deliver``, a body's bytes go there from its leg's reader while it can (``Relay``)."""
        chunks: AsyncIterator[bytes] | None = None
        relay: Relay | None = None
        for step in run:
            if type(step) is bytes:
                yield step
                continue
            relayed: Relayed = READ
            with run:
                if step is steps.NEXT:
                    assert chunks is not None
                    relayed = await relay.over() if relay is not None else READ
                    if relayed is READ:
                        run.result = await anext(chunks, None)
                elif type(step) is steps.Chunks:
                    stream = step.response.stream if step.rest is None else _again(step.read, step.rest)
                    run.result = chunks = aiter(stream)  # type: ignore[arg-type]
                    relay = Relay.of(run, chunks, deliver)
                else:
                    run.result = await self._steps[type(step)](self, step)
            if relayed is not READ and await settled(relayed):
                return

    async def read(self, request: httpx.Request) -> httpx.Response:
        return await self._read_all(await self.legs.send(request))

    async def _read_all(self, response: httpx.Response) -> httpx.Response:
        try:
            await response.aread()
        finally:
            await response.aclose()
        return response

    async def read_request(self, step: steps.ReadRequest) -> bytes:
        return await step.request.aread()

    async def send_prefill(self, step: steps.SendPrefill) -> httpx.Response:
        return await (self.outliving.read(self.read, step.request) if step.outlive else self.read(step.request))

    async def read_refusal(self, step: steps.ReadRefusal) -> bytes:
        return (await self._read_all(step.response)).content

    async def open(self, step: steps.Open) -> httpx.Response:
        step.request.extensions["trace"] = async_trace(step.watch)
        return await self.legs.send(step.request)

    async def stream(self, step: steps.Stream) -> AsyncDecodeStream:
        return AsyncDecodeStream(self._body(step), self)

    async def close(self, step: steps.Close) -> None:
        await step.response.aclose()

    async def sleep(self, step: steps.Sleep) -> None:
        await anyio.sleep(step.seconds)

    async def release(self, step: steps.Release) -> None:
        with anyio.CancelScope(shield=True):  # a cancelled caller still frees the blocks
            try:
                step.leg.end((await self.read(step.request)).status_code, None)
            except Exception as exc:
                step.leg.end(None, exc)

    async def concurrently(self, step: steps.Concurrently) -> Any:
        decode = step.sent.in_flight = AsyncDecodeInFlight(self.legs, step.sent.request, step.watch)
        async with anyio.create_task_group() as legs:
            legs.start_soon(decode.run)
            try:
                return await self.drive(step.during())
            except BaseException:
                decode.scope.cancel()
                raise


async def _again(read: list[bytes], rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A read begun before (``Chunks`` with its ``rest``): its chunks again, then the rest of it."""
    for chunk in read:
        yield chunk
    async for chunk in rest:
        yield chunk


__all__ = ["AsyncDriver", "SyncDriver"]
