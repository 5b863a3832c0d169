"""``StallLedger``: the streams running on one endpoint, and how long the decode-only turns
admitted there while they ran have made them wait.

A stall budget (``conversations.ConversationSettings.stall_budget_ms``) is a share of one
answer's time, so it bounds what every turn admitted while that answer streams adds up to,
not each turn alone: at high concurrency several turns arrive during one answer, and a
stream stalled by each of them is stalled by their sum. Every stall is charged to every
stream running when its turn was admitted, so the most stalled stream is the oldest, and
what it was charged is the sum of the stalls since it began: one running total, and each
stream's value of it at its start, is the whole ledger.
"""

from __future__ import annotations

import threading
from collections import Counter


class StallLedger:
    """This process's streams running on one endpoint (a call whose answer has begun there),
    and the stalls charged to them (``charge``). Thread-safe; a decision reads
    ``most_charged_ms`` and charges in two steps, so two threads deciding at the same moment
    may each admit a turn that only one of them would have: one turn over, not an unbounded
    sum (the proxy decides on one event loop, where this does not happen)."""

    def __init__(self) -> None:
        self._charged = 0.0
        """Every stall charged while a stream ran, summed."""
        self._starts: Counter[float] = Counter()
        """How many running streams began at each value of ``_charged``."""
        self._running = 0
        self._lock = threading.Lock()

    @property
    def running(self) -> int:
        """The streams running now."""
        return self._running

    def begin(self) -> float:
        """A stream has begun; the value ``end`` takes when it ends."""
        with self._lock:
            start = self._charged
            self._starts[start] += 1
            self._running += 1
            return start

    def end(self, start: float) -> None:
        """The stream that ``begin`` gave ``start`` has ended."""
        with self._lock:
            left = self._starts[start] - 1
            if left > 0:
                self._starts[start] = left
            else:
                del self._starts[start]
            self._running -= 1

    def charge(self, stall_ms: float) -> None:
        """A decode-only turn admitted now is predicted to make every running stream wait
        ``stall_ms``; nothing to charge when none runs."""
        if not 0 < stall_ms < float("inf"):
            return
        with self._lock:
            if self._starts:
                self._charged += stall_ms

    def most_charged_ms(self) -> float:
        """The stall charged to the most stalled running stream, the oldest (0: none runs)."""
        with self._lock:
            return self._charged - min(self._starts) if self._starts else 0.0


__all__ = ["StallLedger"]
