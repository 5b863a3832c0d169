"""``DispatchChooser``: whether a handoff's decode goes out with its prefill (``concurrent``)
or after it (``sequential``), from the times to first token each mode gave on that prefill
endpoint.

Concurrency hides the handover (the decode renders the prompt and allocates its blocks
while the prefill computes), and costs a decode that waits: its blocks are held for the
prefill's whole time, and on a CPU pair it takes the core the prefill needs (measured:
concurrent 1.49x sequential's time to first token at ~1k tokens on an AVX-512 EPYC). So
each mode's time is learnt per prefill endpoint, and concurrent is taken only where it is
predicted faster by more than ``CONCURRENT_MARGIN``. The mode not taken is tried again
once every ``PROBE_EVERY`` calls (counted, not drawn at random: every process with the
same traffic probes alike), so a change of regime is seen. After two changes of a prefill
server's coordinates within ``UNSTABLE_WINDOW_S`` (a server restarting), that endpoint is
sequential for ``SEQUENTIAL_FOR_S``, as llm-d's routing sidecar does.
"""

from __future__ import annotations

import enum
from collections import OrderedDict, deque
from dataclasses import dataclass

from ._line import CostLine, Line
from ._priors import CostPriors

SEQUENTIAL = "sequential"
CONCURRENT = "concurrent"
CONCURRENT_MARGIN = 0.95
"""Concurrent must be predicted below this fraction of sequential's time to first token:
the waiting decode's blocks and registration are a cost the time alone does not show."""
PROBE_EVERY = 16
"""One call in this many per prefill endpoint goes the mode not chosen, to keep its time fresh."""
UNSTABLE_WINDOW_S = 300.0
SEQUENTIAL_FOR_S = 600.0
_MAX_ENDPOINTS = 256


class DispatchReason(str, enum.Enum):
    """Why ``dispatch="auto"`` sent a handoff's legs as it did (``PDTrace.decision``)."""

    LEARNING = "learning"
    """Too few timings of one mode on this prefill endpoint: it is tried (the modes take
    turns). Only streamed calls time a first token: other calls alternate while nothing is learnt."""
    CONCURRENT_FASTER = "concurrent_faster"
    SEQUENTIAL_FASTER = "sequential_faster"
    PROBE = "probe"
    """The mode not chosen, once every ``PROBE_EVERY`` calls."""
    COORDINATES_UNSTABLE = "coordinates_unstable"
    """The prefill server's coordinates changed twice within ``UNSTABLE_WINDOW_S``."""


@dataclass(frozen=True)
class DispatchChoice:
    mode: str
    reason: DispatchReason
    sequential_ms: float
    concurrent_ms: float
    """The predicted times to first token of each mode (ms)."""


class _Endpoint:
    __slots__ = ("calls", "changes", "engine_id", "lines", "sequential_until")

    def __init__(self, priors: CostPriors) -> None:
        self.lines = {
            mode: CostLine(priors.handoff, window=priors.window, min_samples=priors.min_samples)
            for mode in (SEQUENTIAL, CONCURRENT)
        }
        self.calls = 0
        self.changes: deque[float] = deque(maxlen=2)
        self.sequential_until = float("-inf")
        self.engine_id: str | None = None


class DispatchChooser:
    """Per prefill endpoint: each mode's learnt time to first token, and the choice. Not
    thread-safe on its own: ``CostModel`` holds the lock."""

    def __init__(self, priors: CostPriors) -> None:
        self._priors = priors
        self._endpoints: OrderedDict[str, _Endpoint] = OrderedDict()

    def _endpoint(self, url: str) -> _Endpoint:
        endpoint = self._endpoints.get(url)
        if endpoint is None:
            endpoint = self._endpoints[url] = _Endpoint(self._priors)
            while len(self._endpoints) > _MAX_ENDPOINTS:
                self._endpoints.popitem(last=False)
        self._endpoints.move_to_end(url)
        return endpoint

    def line(self, url: str, mode: str) -> Line:
        return self._endpoint(url).lines[mode].line()

    def observe(self, url: str, mode: str, tokens: int, ttft_ms: float) -> None:
        if mode in (SEQUENTIAL, CONCURRENT):
            self._endpoint(url).lines[mode].add(tokens, ttft_ms)

    def coordinates(self, url: str, engine_id: str, now: float) -> None:
        """A prefill answer's engine id, at ``now`` (seconds, any monotonic clock)."""
        endpoint = self._endpoint(url)
        if endpoint.engine_id is not None and engine_id != endpoint.engine_id:
            endpoint.changes.append(now)
            if len(endpoint.changes) == 2 and now - endpoint.changes[0] <= UNSTABLE_WINDOW_S:
                endpoint.sequential_until = now + SEQUENTIAL_FOR_S
        endpoint.engine_id = engine_id

    def choose(self, url: str, tokens: int, now: float) -> DispatchChoice:
        endpoint = self._endpoint(url)
        sequential, concurrent = endpoint.lines[SEQUENTIAL], endpoint.lines[CONCURRENT]
        seq_ms, con_ms = sequential.line().at(tokens), concurrent.line().at(tokens)
        endpoint.calls += 1

        def choice(mode: str, reason: DispatchReason) -> DispatchChoice:
            return DispatchChoice(mode, reason, seq_ms, con_ms)

        if now < endpoint.sequential_until:
            return choice(SEQUENTIAL, DispatchReason.COORDINATES_UNSTABLE)
        needed = self._priors.min_samples
        if len(sequential) < needed or len(concurrent) < needed:
            # The mode with fewer timings; the modes take turns while they have as many
            # (calls that teach nothing, not streamed, leave both at none).
            taken, tried = len(sequential), len(concurrent)
            fewer = tried < taken or (tried == taken and endpoint.calls % 2 == 1)
            return choice(CONCURRENT if fewer else SEQUENTIAL, DispatchReason.LEARNING)
        if con_ms < seq_ms * CONCURRENT_MARGIN:
            best, other, reason = CONCURRENT, SEQUENTIAL, DispatchReason.CONCURRENT_FASTER
        else:
            best, other, reason = SEQUENTIAL, CONCURRENT, DispatchReason.SEQUENTIAL_FASTER
        if endpoint.calls % PROBE_EVERY == 0:
            return choice(other, DispatchReason.PROBE)
        return choice(best, reason)


__all__ = [
    "CONCURRENT",
    "CONCURRENT_MARGIN",
    "PROBE_EVERY",
    "SEQUENTIAL",
    "SEQUENTIAL_FOR_S",
    "UNSTABLE_WINDOW_S",
    "DispatchChoice",
    "DispatchChooser",
    "DispatchReason",
]
