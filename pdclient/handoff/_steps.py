"""The I/O a call's flow asks its driver for, one step at a time.

A flow (``_flow.call_flow``, ``_move.move``) is a generator, as httpx's ``Auth.auth_flow``
is: it yields a step, and is sent the step's result or has its exception thrown in. The
two drivers (``transport._drivers``) run the steps, one with blocking calls and one with
``await``; every decision is the flow's. What only an async driver can do is a rule of
that driver's, written once: a ``Release`` and a ``Discard`` are shielded from the
caller's cancel, a ``SendPrefill`` with ``outlive`` goes on in a task of its own when its caller
leaves (asyncio), and a ``Concurrently`` runs its decode in a task group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from types import TracebackType
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import httpx

from ..pools import Sleep

if TYPE_CHECKING:
    from ._call import Call
    from ._dispatch import ConcurrentDecode
    from ._leg import Leg

STREAM_ERRORS = (httpx.TransportError, httpx.DecodingError)
"""What a decode stream raises when it breaks (a reset, a server gone, a read timeout)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ReadRequest:
    """Read the caller's request body (a P/D call's, or a pass-through's that is not an upload)."""

    request: httpx.Request


@dataclasses.dataclass(frozen=True, slots=True)
class SendPrefill:
    """Send a leg and read its whole body, its connection back in the pool; the result is the response.

    ``outlive``: a concurrent call's prefill, read to its end even if its caller leaves
    meanwhile (the decode sent with it holds blocks its WRITE alone frees)."""

    request: httpx.Request
    outlive: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Open:
    """Send a decode leg; the result is its response, headers in, body unread. ``watch``
    sees httpcore's trace events of the request (the bytes going out)."""

    request: httpx.Request
    watch: Callable[[str], None]


@dataclasses.dataclass(frozen=True, slots=True)
class OpenDecode:
    """Open the call's decode leg, retried as any decode leg (``_flow.open_decode``); the
    result is the streaming response."""

    call: Call


@dataclasses.dataclass(frozen=True, slots=True)
class Close:
    """Close a response whose body nobody will read."""

    response: httpx.Response


@dataclasses.dataclass(frozen=True, slots=True)
class ReadRefusal:
    """Read a refused decode response's body and close it; the result is the body."""

    response: httpx.Response


@dataclasses.dataclass(frozen=True, slots=True)
class Release:
    """Send a KV release leg and end it with its status or error; never fails (shielded on async)."""

    leg: Leg
    request: httpx.Request


@dataclasses.dataclass(frozen=True, slots=True)
class Concurrently:
    """Send ``sent``'s decode (``watch`` sees its trace events) while the ``during`` steps run
    (its prefill phase); the result is ``during``'s. The driver keeps its handle on the decode
    in ``sent.in_flight`` for ``Await``, ``Cut`` and ``Discard``; when ``during`` raises, the
    decode is cut before the exception goes on."""

    sent: ConcurrentDecode
    watch: Callable[[str], None]
    during: Callable[[], Generator[Any, Any, Any]]


@dataclasses.dataclass(frozen=True, slots=True)
class Await:
    """The concurrent decode's outcome once it is over: ``(response or None, error or None)``."""

    sent: ConcurrentDecode


@dataclasses.dataclass(frozen=True, slots=True)
class Cut:
    """Stop the concurrent decode wherever it is (cancel its task, or cut its connection)."""

    sent: ConcurrentDecode


@dataclasses.dataclass(frozen=True, slots=True)
class Discard:
    """Once cut: close the response the concurrent decode left (shielded on async); the result
    is ``(its status or None, the decode's error or None)``, which its leg ends with."""

    sent: ConcurrentDecode


@dataclasses.dataclass(frozen=True, slots=True)
class Chunks:
    """Start reading ``response``'s body: the ``NEXT`` steps that follow read its chunks; the
    result is the read itself. With ``rest`` (such a read begun before, ``read`` the chunks
    it gave), they give ``read`` again and then go on with ``rest``."""

    response: httpx.Response
    read: list[bytes] = dataclasses.field(default_factory=list)
    rest: Any = None


class NextChunk:
    """The next chunk of the body being read (``Chunks``); the result is None at its end."""

    __slots__ = ()


NEXT = NextChunk()


@dataclasses.dataclass(frozen=True, slots=True)
class Stream:
    """The caller's body for the call's decode response: the driver's stream (moved by this
    driver if it breaks); the result is the body."""

    call: Call
    response: httpx.Response
    begun: Chunks | None = None
    """The body's read, if one began already (``Chunks`` with its ``rest``)."""


Step = (
    ReadRequest
    | SendPrefill
    | Open
    | OpenDecode
    | Close
    | ReadRefusal
    | Release
    | Concurrently
    | Await
    | Cut
    | Discard
    | Stream
    | Sleep
    | Chunks
    | NextChunk
)
Flow = Generator[Step, Any, Any]

T = TypeVar("T")


class FlowRun(Generic[T]):
    """A flow as a driver runs it, the one way both drivers and both decode streams do.

    Iterating it gives the flow's steps; each next step resumes the flow with ``result``, set
    by the driver for the step before, or throws in the exception that step raised inside
    ``with run:`` (any exception, a cancel too: the flow decides what it means). When the
    flow returns, the iteration ends and ``value`` is what it returned.
    """

    __slots__ = ("_again", "_failure", "_flow", "result", "value")

    def __init__(self, flow: Generator[Any, Any, T]) -> None:
        self._flow = flow
        self._failure: BaseException | None = None
        self._again: Any = None
        self.result: Any = None
        self.value: T

    def __iter__(self) -> FlowRun[T]:
        return self

    def again(self, step: Any) -> None:
        """The next step is ``step`` once more, the flow not resumed: a step taken from the
        flow by someone else (a relay) that the driver is to run after all."""
        self._again = step

    def __next__(self) -> Any:
        if (step := self._again) is not None:
            self._again = None
            return step
        result, failure = self.result, self._failure
        self.result = self._failure = None
        try:
            return self._flow.send(result) if failure is None else self._flow.throw(failure)
        except StopIteration as done:
            self.value = done.value
            raise

    def __enter__(self) -> None:
        return None

    def __exit__(
        self, kind: type[BaseException] | None, failure: BaseException | None, traceback: TracebackType | None
    ) -> bool:
        self._failure = failure
        return True


__all__ = [
    "NEXT",
    "STREAM_ERRORS",
    "Chunks",
    "NextChunk",
    "Await",
    "Close",
    "Concurrently",
    "Cut",
    "Discard",
    "Flow",
    "FlowRun",
    "Open",
    "OpenDecode",
    "ReadRefusal",
    "ReadRequest",
    "Release",
    "SendPrefill",
    "Sleep",
    "Step",
    "Stream",
]
