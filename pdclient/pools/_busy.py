"""How much of the time this process's calls keep an endpoint busy: ``BusyShare``.

A server's load samples (``fleet._load``) say how many requests it holds at one instant; the
background work that would borrow a server's idle time (``fleet._warm``: prefill warm-ups)
needs to know how much idle time there is. ``BusyShare`` is the share of recent time with at
least one of this process's requests in flight on the endpoint: a time-weighted moving
average of that 0/1 signal over about ``tau`` seconds, kept in O(1) at each change of it.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

TAU = 30.0
"""Seconds the share looks back over: several calls' worth of a busy server's steps, so
one long prefill does not read as a busy server, nor one pause as an idle one."""


class BusyShare:
    """The moving share of time (0-1) with this process's requests in flight on one endpoint."""

    def __init__(self, tau: float = TAU, clock: Callable[[], float] = time.monotonic) -> None:
        self.tau = tau
        self._clock = clock
        self._busy = False
        self._share = 0.0
        self._at = clock()
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"BusyShare({self.share():.2f})"

    def set(self, busy: bool) -> None:
        """The endpoint went busy (a first request in flight) or idle (the last one ended)."""
        now = self._clock()
        with self._lock:
            self._share = self._at_time(now)
            self._at = now
            self._busy = busy

    def share(self, now: float | None = None) -> float:
        """The share now (or at ``now``, clock time): 0 for an endpoint never busy."""
        with self._lock:
            return self._at_time(self._clock() if now is None else now)

    def _at_time(self, now: float) -> float:
        target = 1.0 if self._busy else 0.0
        return target + (self._share - target) * math.exp(-max(0.0, now - self._at) / self.tau)
