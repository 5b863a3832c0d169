"""A decode body relayed to its caller from the leg reader's own callback.

A proxy's call streams a token every few tens of milliseconds, and between two of them
the process sleeps. What runs at each wake-up runs cold (caches, branch predictors and
TLB filled by the servers beside it), several times slower than the same code run hot:
on a 2-core Zen 4 EPYC, a chunk of a paced stream cost the bare uvicorn+aiohttp proxy
~260 us of CPU and ~170 us relayed (``benchmarks/bare_proxy.py --relay``), against 51 and
36 us on back-to-back stubs. Read the usual way, a chunk wakes a future, steps the call's
task and resumes its chain of coroutines (the caller's loop, the driver, the leg's reader);
relayed, the leg's reader hands it to ``Relay`` as it is parsed, which runs the body's
steps on it (``FlowRun``) and sends the bytes they give through the caller's ``deliver``,
there and then.

The relay stays in the callback only while all the body does there is synchronous: its
bytes sent without waiting, its next step another chunk. Anything else hands the body
back to the driver's async path where it stood, and that path goes on as if it had read
the chunks itself:

- ``READ``: the leg's end or its error (the reader is read again, and says which);
- ``AGAIN``: a step the driver runs (a move's legs), put back with ``FlowRun.again``;
- ``Waiting``: a caller whose send must wait (flow control), awaited in the call's task;
- ``DONE``: the body's end; an exception: what the body or the send raised.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Awaitable, Callable, Generator, Iterator
from typing import Any, Protocol, runtime_checkable

from ..handoff import steps

Deliver = Callable[[bytes], Awaitable[None] | None]
"""The caller's side of a body's bytes: None once they are sent, else what sends them."""


class HandedBack(enum.Enum):
    """Where a relay left the body for the driver's async path."""

    READ = "read"
    """At its ``NEXT``: the reader is read again (the leg's end or error, or nothing pushed)."""
    AGAIN = "again"
    """At a step the driver runs (``FlowRun.again``)."""
    DONE = "done"
    """At its end."""


READ, AGAIN, DONE = HandedBack.READ, HandedBack.AGAIN, HandedBack.DONE


@runtime_checkable
class Pushing(Protocol):
    """A body's chunks that can be pushed to a sink as they arrive, instead of read."""

    def push(self, sink: Callable[[bytes | None], None]) -> bool:
        """From now on each chunk goes to ``sink`` as it arrives, until ``stop``; its end or
        its error stops the pushing and calls ``sink(None)`` (read it then, as before). False,
        and nothing pushed: there is something to read now (a chunk, the end, an error)."""
        ...

    def stop(self) -> None:
        """No more pushing: chunks are buffered for a read again (idempotent)."""
        ...


class Waiting:
    """A send stepped in the callback that must wait: the rest of it, awaited in the task."""

    __slots__ = ("_sending", "_yielded")

    def __init__(self, sending: Generator[Any, Any, Any], yielded: Any) -> None:
        self._sending = sending
        self._yielded = yielded

    def __await__(self) -> Generator[Any, Any, None]:
        sending, yielded = self._sending, self._yielded
        while True:
            try:
                sent = yield yielded  # what it waits on, now waited on by the task
            except BaseException as exc:  # a cancel too: the send decides
                try:
                    yielded = sending.throw(exc)
                except StopIteration:
                    return
            else:
                try:
                    yielded = sending.send(sent)
                except StopIteration:
                    return


def _sent(sending: Awaitable[None]) -> Waiting | None:
    """``sending`` run as far as it goes without waiting: None when it is done."""
    stepper: Iterator[Any] = sending.__await__()
    try:
        yielded = next(stepper)
    except StopIteration:
        return None
    return Waiting(stepper, yielded)  # type: ignore[arg-type]


Relayed = HandedBack | Waiting | BaseException
"""How a relay handed the body back: ``READ``, ``AGAIN``, ``DONE``, a send to await, or what to raise."""


class Relay:
    """Runs a body's steps on its chunks in the leg reader's callback while it can (the module's docstring)."""

    __slots__ = ("_deliver", "_done", "_run", "_source")

    def __init__(self, run: steps.FlowRun[Any], source: Pushing, deliver: Deliver) -> None:
        self._run = run
        self._source = source
        self._deliver = deliver
        self._done: asyncio.Future[Relayed] | None = None

    @classmethod
    def of(cls, run: steps.FlowRun[Any], chunks: object, deliver: Deliver | None) -> Relay | None:
        """The relay of a body being read from ``chunks``, if they can be pushed and there is a ``deliver``."""
        return cls(run, chunks, deliver) if deliver is not None and isinstance(chunks, Pushing) else None

    async def over(self) -> Relayed:
        """The body relayed from its next chunk on, until it is handed back; ``READ`` at once
        when there is something to read now. Its steps run between this call's awaits only,
        so the body stands at its ``NEXT`` whenever a cancel comes in."""
        done: asyncio.Future[Relayed] = asyncio.get_running_loop().create_future()
        self._done = done
        if not self._source.push(self._chunk):
            return READ
        try:
            return await done
        finally:
            self._source.stop()

    def _chunk(self, chunk: bytes | None) -> None:
        if chunk is None:
            self._hand_back(READ)
            return
        run = self._run
        run.result = chunk
        deliver = self._deliver
        try:
            for step in run:
                if type(step) is bytes:
                    sending = deliver(step)
                    if sending is not None and (waiting := _sent(sending)) is not None:
                        self._hand_back(waiting)
                        return
                elif step is steps.NEXT:
                    return  # the next chunk comes here too
                else:
                    run.again(step)
                    self._hand_back(AGAIN)
                    return
        except BaseException as exc:  # raised in the call's task, not in aiohttp's parser
            self._hand_back(exc)
            return
        self._hand_back(DONE)

    def _hand_back(self, relayed: Relayed) -> None:
        self._source.stop()  # what the same parse still feeds is buffered for the task's read
        done = self._done
        if done is not None and not done.done():
            done.set_result(relayed)


async def settled(relayed: Relayed) -> bool:
    """What the driver's async path does with a body handed back: True at the body's end."""
    if isinstance(relayed, HandedBack):
        return relayed is DONE  # else at its NEXT, to be read, or at a step to run
    if isinstance(relayed, Waiting):
        await relayed
        return False
    raise relayed  # what the body or the send raised, for the caller's loop: not the body's to see again


__all__ = ["AGAIN", "DONE", "READ", "Deliver", "HandedBack", "Pushing", "Relay", "Relayed", "Waiting", "settled"]
