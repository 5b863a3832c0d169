"""Latency signals: how long each endpoint took to answer this process's calls.

A server's request counts (``fleet._load``) say how busy it is, not how fast it works through
that load: a server on slower hardware, or one whose slots another tenant's long requests
hold, answers the same count more slowly. Each endpoint keeps a peak-sensitive moving
average of how long its answers took (``PeakEWMA``), as Finagle's ``PeakEwma`` and tower's
``peak_ewma`` balancers (linkerd) do for request latency: an observation above the
estimate replaces it at once, one below it pulls it down by the time since the last one
(``tau``, 10 s as both default to), and the estimate decays toward zero while nothing is
observed, so an endpoint that went quiet is tried again instead of shunned for good.

What is observed is a time that does not grow with the prompt's or the answer's length
where it can be helped: a prefill leg's whole answer (one token; its prompt's length does
count), and a streamed decode's time from sending to its body's end over the network reads
it took, about one per engine step (queueing for a slot and the KV pull spread over them).
A caller that reads slowly makes its decode endpoint look slow: pdclient reads the stream
as the caller does.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

TAU = 10.0


class PeakEWMA:
    """A peak-sensitive, time-weighted moving average of one endpoint's answer times (ms)."""

    def __init__(self, tau: float = TAU, clock: Callable[[], float] = time.monotonic) -> None:
        self.tau = tau
        self._clock = clock
        self._value: float | None = None
        self._at = 0.0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        estimate = self.estimate()
        return f"PeakEWMA({'none' if estimate is None else f'{estimate:.1f} ms'})"

    def observe(self, ms: float) -> None:
        now = self._clock()
        with self._lock:
            current = self._decayed(now)
            if current is None or ms >= current:
                self._value = ms
            else:  # between the two: the longer since the last observation, the more this one counts
                weight = math.exp(-max(0.0, now - self._at) / self.tau)
                self._value = current * weight + ms * (1 - weight)
            self._at = now

    def estimate(self) -> float | None:
        """The estimate now (ms), or None before the first observation."""
        with self._lock:
            return self._decayed(self._clock())

    def _decayed(self, now: float) -> float | None:
        if self._value is None:
            return None
        return self._value * math.exp(-max(0.0, now - self._at) / self.tau)
