"""``CostPriors``: what the cost model assumes before live traffic teaches it otherwise."""

from __future__ import annotations

from dataclasses import dataclass, field

from ._line import Line


@dataclass(frozen=True)
class CostPriors:
    """The lines used until an endpoint has ``min_samples`` live samples.

    Chosen so that a fleet with no traffic yet decides about as the fixed rule did (a turn
    of 256 uncached tokens or more is a handoff): a decode server is taken to prefill at
    1 ms a token (a small model on a CPU core; a GPU is ~100x faster, and learns so within
    a few calls) and a handover to cost 256 ms more than a decode-only call's first step,
    so that 256 tokens is where the two routes' first tokens meet. The prefill server's own
    compute is taken as part of that handover until it is learnt.
    """

    decode_prefill: Line = field(default_factory=lambda: Line(fixed_ms=10.0, ms_per_token=1.0))
    """A decode-only call's time to first token against its uncached tokens."""
    handoff: Line = field(default_factory=lambda: Line(fixed_ms=266.0, ms_per_token=0.0))
    """A P/D call's time to first token against the tokens its prefill computes."""
    answer_ms: float = 1500.0
    """A decode endpoint's streams' answer time, first token to last, until learnt: ~40
    tokens at ~38 ms, so that the default stall budget (a tenth of it) is 150 ms."""
    window: int = 24
    """Samples each line is fitted to (the most recent)."""
    min_samples: int = 4
    """Samples before a line is fitted to them instead of the prior."""


__all__ = ["CostPriors"]
