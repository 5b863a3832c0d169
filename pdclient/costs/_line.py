"""``CostLine``: a time that grows with a token count (``ms = fixed + per_token * tokens``),
fitted to the last samples of live traffic, with a prior's slope until there are enough.

The fit is Theil-Sen (the median of the slopes between pairs of samples, then the median
intercept): one call queued behind a long prompt, or one answered from a warm cache,
moves neither the slope nor the step, where a least-squares line would follow it. It
uses no randomness, so every process that saw the same samples predicts the same times.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from .._errors import PDConfigError

_MIN_SPREAD_TOKENS = 16
"""Two samples closer than this in tokens say nothing of the slope (their difference in
time is noise): the pair is left out of the slope's median."""
_MAX_MS_PER_TOKEN = 100.0
"""A slope above this is no server's prefill (a CPU computes a small model's token in
~1 ms): the samples were queueing, not computing."""


@dataclass(frozen=True)
class Line:
    """A time in milliseconds as a function of a token count."""

    fixed_ms: float
    """What a call of no tokens pays: a scheduler step, a request's round trip, a handover."""
    ms_per_token: float
    samples: int = 0
    """The live samples it was fitted to (0: the prior)."""

    def __post_init__(self) -> None:
        for name in ("fixed_ms", "ms_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise PDConfigError(f"{name} must be a finite number >= 0, got {value!r}")

    def at(self, tokens: int) -> float:
        return self.fixed_ms + self.ms_per_token * max(0, tokens)


class CostLine:
    """A ``Line`` learnt from (tokens, ms) samples: the prior's slope with the samples'
    median step until ``min_samples`` (and pairs far enough apart), then the Theil-Sen fit
    of the last ``window`` (bounded memory). Not thread-safe on its own:
    ``CostModel`` holds the lock."""

    __slots__ = ("_fitted", "_samples", "min_samples", "prior")

    def __init__(self, prior: Line, *, window: int = 24, min_samples: int = 4) -> None:
        self.prior = prior
        self.min_samples = min_samples
        self._samples: deque[tuple[int, float]] = deque(maxlen=window)
        self._fitted: Line | None = prior

    def add(self, tokens: int, ms: float) -> None:
        if tokens < 0 or not 0 <= ms < float("inf"):
            return  # not a measurement: a clock that went back, a count no server gave
        self._samples.append((tokens, ms))
        self._fitted = None

    def __len__(self) -> int:
        return len(self._samples)

    def line(self) -> Line:
        if self._fitted is None:
            self._fitted = self._fit()
        return self._fitted

    def _fit(self) -> Line:
        samples = list(self._samples)
        if not samples:
            return self.prior
        slopes = [
            (b_ms - a_ms) / (b_tokens - a_tokens)
            for i, (a_tokens, a_ms) in enumerate(samples)
            for b_tokens, b_ms in samples[i + 1 :]
            if abs(b_tokens - a_tokens) >= _MIN_SPREAD_TOKENS
        ]
        # Too few samples, or too little spread in their counts (every turn alike), to see a
        # slope: the prior's, and the step is what the samples leave over.
        enough = len(samples) >= self.min_samples and len(slopes) >= self.min_samples
        slope = statistics.median(slopes) if enough else self.prior.ms_per_token
        slope = min(max(slope, 0.0), _MAX_MS_PER_TOKEN)
        fixed = statistics.median(ms - slope * tokens for tokens, ms in samples)
        if fixed < 0:
            # The samples are faster than the slope allows at any step (a prior's slope, on a
            # server quicker than it assumes): their own median time per token, no step.
            rates = [ms / tokens for tokens, ms in samples if tokens > 0]
            slope, fixed = (min(slope, statistics.median(rates)) if rates else slope), 0.0
        return Line(fixed, slope, len(samples))


__all__ = ["CostLine", "Line"]
