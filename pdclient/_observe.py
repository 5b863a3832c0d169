"""The observer seam: watching a call without touching how it runs.

An observer receives five events per chat or completions call, synchronously, in the
thread or task that makes the call (as httpx's event hooks and tenacity's ``before`` /
``after`` do), so one observer class serves the sync and the async clients::

    on_call_start(call)                       the caller's request arrived; nothing sent yet
    on_leg_start(call, leg)                   a leg request is about to be sent (each attempt)
    on_leg_end(call, leg, status, error)      that attempt is over: its body was read or closed
    on_first_byte(call)                       the decode's first body byte reached the caller
    on_call_end(call, trace)                  the call is over; ``trace`` is its PDTrace

Pass-through requests (models, embeddings, ...) are calls too (``call.route ==
"passthrough"``) with one ``decode`` leg. Every ``on_call_start`` is followed by exactly
one ``on_call_end``, also when the call fails, is refused or is abandoned by its caller;
every ``on_leg_start`` by exactly one ``on_leg_end``. An observer's exception is logged
and never fails the call. Observers shared by threads must be thread-safe.

``call`` and ``leg`` are read-only views (``CallView``, ``LegView``); ``call.data`` is a
dict an observer may use to keep its own per-call state (key it by the observer).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, MutableMapping
from typing import TYPE_CHECKING, Any, Protocol

import httpx

if TYPE_CHECKING:
    from ._trace import PDTrace
    from .routing import RouteDecision

logger = logging.getLogger("pdclient")


class CallView(Protocol):
    """What an observer may read of a call."""

    @property
    def request_id(self) -> str:
        """The caller's correlation id: its ``x-request-id``, else a random one."""
        ...

    @property
    def leg_request_id(self) -> str:
        """The ``x-request-id`` the call's legs carry: random, never the caller's."""
        ...

    @property
    def route(self) -> str:
        """``chat``, ``completions`` or ``passthrough``."""
        ...

    @property
    def request(self) -> httpx.Request:
        """The caller's request, as the openai SDK built it."""
        ...

    @property
    def started(self) -> float:
        """``time.perf_counter()`` when the call started."""
        ...

    @property
    def data(self) -> MutableMapping[Any, Any]:
        """Per-call scratch space for observers."""
        ...


class LegView(Protocol):
    """What an observer may read of one leg attempt."""

    @property
    def name(self) -> str:
        """``prefill``, ``decode`` or ``release`` (the one-token decode that frees an abandoned handoff's KV)."""
        ...

    @property
    def url(self) -> str:
        """The endpoint's base URL."""
        ...

    @property
    def attempt(self) -> int:
        """1 for the first attempt of this leg in this call, 2 for its first retry or the
        continuation after a decode migration, ..."""
        ...

    @property
    def request(self) -> httpx.Request: ...
    @property
    def decision(self) -> RouteDecision | None:
        """How the routing policy chose this attempt's endpoint (None for a fallback URL outside the pools)."""
        ...

    @property
    def sent_at(self) -> float:
        """``time.perf_counter()`` when the request was handed to the leg transport."""
        ...


class PDObserver:
    """Base class: override the events you need; the rest do nothing."""

    def on_call_start(self, call: CallView) -> None:
        pass

    def on_leg_start(self, call: CallView, leg: LegView) -> None:
        pass

    def on_leg_end(self, call: CallView, leg: LegView, status: int | None, error: BaseException | None) -> None:
        pass

    def on_first_byte(self, call: CallView) -> None:
        pass

    def on_call_end(self, call: CallView, trace: PDTrace) -> None:
        pass


class TraceCallback(PDObserver):
    """``on_trace=``: a callable that receives each finished call's PDTrace."""

    def __init__(self, callback: Callable[[PDTrace], None]) -> None:
        self.callback = callback

    def on_call_end(self, call: CallView, trace: PDTrace) -> None:
        if trace.route != "passthrough":
            self.callback(trace)

    def __repr__(self) -> str:
        return f"TraceCallback({self.callback!r})"


class Observers:
    """Fans each event out to several observers; an observer that raises is logged and skipped."""

    __slots__ = ("_observers",)

    def __init__(self, observers: Iterable[PDObserver]) -> None:
        self._observers = tuple(observers)

    def __bool__(self) -> bool:
        return bool(self._observers)

    def _each(self, event: str, *args: Any) -> None:
        for observer in self._observers:
            try:
                getattr(observer, event)(*args)
            except Exception:
                logger.exception("observer %r raised in %s", observer, event)

    def call_start(self, call: CallView) -> None:
        self._each("on_call_start", call)

    def leg_start(self, call: CallView, leg: LegView) -> None:
        self._each("on_leg_start", call, leg)

    def leg_end(self, call: CallView, leg: LegView, status: int | None, error: BaseException | None) -> None:
        self._each("on_leg_end", call, leg, status, error)

    def first_byte(self, call: CallView) -> None:
        self._each("on_first_byte", call)

    def call_end(self, call: CallView, trace: PDTrace) -> None:
        self._each("on_call_end", call, trace)
