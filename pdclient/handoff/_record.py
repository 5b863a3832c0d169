"""What a call's report reads (``_report.trace_of``): how it ended, why, and its timings;
and what its end teaches (``RemotePrefill.ended``): the cost model its time to first
token, the conversation memory the ids its decode sent.

The flow and the decisions it applies write it; nothing in it steers the call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._trace import Outcome
from ..costs import DispatchChoice
from ..migration import Tracker


@dataclass(slots=True)
class CallRecord:
    outcome: Outcome
    error: str | None = None
    failed_leg: str | None = None
    fallback: str | None = None
    """How the call degraded, for people (the failure policy's note, a concurrent decode's fall-back)."""
    dispatch: str | None = None
    """How the legs went out, ``sequential`` or ``concurrent`` (``_dispatch``), once a prefill is planned."""
    dispatch_choice: DispatchChoice | None = None
    """What ``dispatch="auto"`` predicted and chose on the cost model (None: it did not choose)."""
    dispatch_fallback: str | None = None
    """Why a concurrent decode went out again sequentially (``_dispatch``'s reasons)."""
    cpu_seconds: float = 0.0
    """The handoff's own CPU: reading the prefill's answer, building the decode body."""
    prefill_ms: float | None = None
    decode_headers_ms: float | None = None
    decode_first_byte_ms: float | None = None
    first_byte_ms: float | None = None
    """From the call's start to the decode's first byte (the caller's time to first token, streamed)."""
    first_token_ms: float | None = None
    """``first_byte_ms`` of a streamed call on the route it planned, what the cost model
    learns (None: not streamed, none yet, or its stream moved or went to a fallback server)."""
    answer_ms: float | None = None
    """From ``first_token_ms`` to the call's end (its stream read to its end, or closed):
    the decode's answer time as the caller read it (None: no ``first_token_ms``)."""
    decoded: Tracker | None = None
    """The ids the decode leg sent, when it was asked for them (the stream that answered)."""

    def ended(self, elapsed_ms: float) -> None:
        """The call ended ``elapsed_ms`` after it started: its answer's time, if it had a first token."""
        if self.first_token_ms is not None:
            self.answer_ms = elapsed_ms - self.first_token_ms


__all__ = ["CallRecord"]
