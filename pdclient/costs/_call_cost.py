"""``CallCost``: what one finished call teaches the cost model (``CostModel.learn``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CallCost:
    """A whole streamed call's time to first token on the route it took, against the tokens
    computed for it. Without a prefill endpoint it went decode-only, on ``decode_url``; with
    one it was a handoff, its legs sent the ``dispatch`` way."""

    first_token_ms: float
    decode_url: str
    tokens: int
    """The tokens computed for the call: a decode-only call's uncached ones, a handoff's prefill's."""
    prefill_url: str | None = None
    dispatch: str | None = None
    answer_ms: float | None = None
    """A whole answer's time on ``decode_url``, its first token to its last (None: not
    known whole): what a stall there is a share of (``CostModel.answer_ms``)."""


__all__ = ["CallCost"]
