"""``CostModel``: what each route would cost a call, learnt per endpoint from the calls'
own timings. One per fleet (``Fleet.costs``), shared by the client's copies.

What is learnt, and from what (every time is passed in: the model has no clock):

- **a decode server's prefill rate**: a decode-only call's time to first token against
  the tokens it computed (its uncached tokens: the server's own ``usage`` when it says
  what it found cached, else the estimate), a ``Line`` per decode endpoint: a fixed step
  and milliseconds per token;
- **the handover a P/D call pays**: a handoff's time to first token (the prefill leg, the
  KV's move, the decode's admission and first step) against the tokens its prefill
  computed, a ``Line`` over every handoff, and one per prefill endpoint and dispatch mode
  (``DispatchChooser``);
- **what a decode-only turn costs the decode's other streams**: every stream running there
  waits for the turn's first token, so the stall is the decode line's whole prediction
  for N tokens, charged when streams are running there (the caller counts them: its own
  streams whose answer has begun and the load sample's ``running``). Not only its
  per-token part: on the CPU pair, streams that ran beside decode-only turns lost 1.02 ms
  per ms of the turns' time to first token they overlapped (2,042 requests of vLLM's
  multi-turn benchmark), the step and the server's own work on the request included.

Every line is a robust fit (``CostLine``: medians over a bounded window), so one call
stuck in a queue does not swing the route, and two processes that saw the same traffic
predict alike. Thread-safe: one lock around all of it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

from ._call_cost import CallCost
from ._dispatch_choice import PROBE_EVERY, DispatchChoice, DispatchChooser
from ._line import CostLine, Line
from ._priors import CostPriors

_MAX_ENDPOINTS = 256
"""Decode endpoints whose lines are kept (LRU): a few hundred bytes each."""


@dataclass(frozen=True)
class RouteCosts:
    """The predicted cost of each route for one call (milliseconds)."""

    decode_only_ms: float
    """Its time to first token if sent decode-only to the endpoint holding its conversation."""
    handoff_ms: float
    """Its time to first token through a P/D handoff."""
    stall_ms: float
    """What the decode-only route would make the decode server's running streams wait (0: none run)."""
    compute_ms: float
    """The per-token part of the decode server's time on the call (its uncached tokens at the
    decode line's rate): what bounds a trial of decode-only (``Reason.PROBE``), so that a
    prior's step, or one slow sample's, never stops decode-only from being measured again."""
    streams: int
    """The streams counted running on that decode endpoint."""


class CostModel:
    """Per-endpoint lines learnt from live calls, and the predictions made from them."""

    def __init__(self, priors: CostPriors | None = None) -> None:
        self.priors = priors or CostPriors()
        self._decode: OrderedDict[str, CostLine] = OrderedDict()
        self._asked: dict[str, int] = {}
        """Per decode endpoint, the calls that asked whether decode-only is due a trial."""
        self._handoff = self._new_line(self.priors.handoff)
        self._dispatch = DispatchChooser(self.priors)
        self._lock = threading.Lock()

    def _new_line(self, prior: Line) -> CostLine:
        return CostLine(prior, window=self.priors.window, min_samples=self.priors.min_samples)

    def _decode_line(self, endpoint: str) -> CostLine:
        line = self._decode.get(endpoint)
        if line is None:
            line = self._decode[endpoint] = self._new_line(self.priors.decode_prefill)
            while len(self._decode) > _MAX_ENDPOINTS:
                self._asked.pop(self._decode.popitem(last=False)[0], None)
        self._decode.move_to_end(endpoint)
        return line

    # -- learning ------------------------------------------------------------------------

    def learn(self, cost: CallCost) -> None:
        """What a finished call teaches: the line of the route it took."""
        if cost.prefill_url is None:
            self.decode_only(cost.decode_url, cost.tokens, cost.first_token_ms)
        elif cost.dispatch is not None:
            self.handoff(cost.prefill_url, cost.dispatch, cost.tokens, cost.first_token_ms)

    def decode_only(self, endpoint: str, uncached_tokens: int, ttft_ms: float) -> None:
        """A decode-only call on ``endpoint``: the tokens it computed and its time to first token."""
        with self._lock:
            self._decode_line(endpoint).add(uncached_tokens, ttft_ms)

    def handoff(self, prefill_endpoint: str, dispatch: str, prefill_tokens: int, ttft_ms: float) -> None:
        """A P/D call: the tokens its prefill computed, and its time to first token."""
        with self._lock:
            self._handoff.add(prefill_tokens, ttft_ms)
            self._dispatch.observe(prefill_endpoint, dispatch, prefill_tokens, ttft_ms)

    def coordinates(self, prefill_endpoint: str, engine_id: str, now: float) -> None:
        """The engine id a prefill endpoint's answer gave, at ``now`` (monotonic seconds)."""
        with self._lock:
            self._dispatch.coordinates(prefill_endpoint, engine_id, now)

    # -- reading -------------------------------------------------------------------------

    def decode_prefill(self, endpoint: str) -> Line:
        """The decode endpoint's learnt prefill line (its prior before enough decode-only calls)."""
        with self._lock:
            return self._decode_line(endpoint).line()

    def lines(self) -> list[tuple[str, str, Line]]:
        """What ``auto`` decides with now, as ``(line, endpoint, Line)``: each decode endpoint's
        prefill line (``"decode_prefill"``) and the handoff line over every handoff
        (``"handoff"``, endpoint ``""``), priors included; for a scrape (``metrics``)."""
        with self._lock:
            decode = [("decode_prefill", endpoint, line.line()) for endpoint, line in self._decode.items()]
            return [*decode, ("handoff", "", self._handoff.line())]

    def handover(self, prefill_endpoint: str | None = None, dispatch: str | None = None) -> Line:
        """The handoff line: over every handoff, or one prefill endpoint's in one dispatch mode."""
        with self._lock:
            if prefill_endpoint is None or dispatch is None:
                return self._handoff.line()
            return self._dispatch.line(prefill_endpoint, dispatch)

    def predict(self, decode_endpoint: str | None, uncached_tokens: int, streams: int) -> RouteCosts:
        """Each route's cost for a call of ``uncached_tokens`` whose conversation is held on
        ``decode_endpoint`` (None: no endpoint known, its prior), with ``streams`` running there."""
        with self._lock:
            decode = self._decode_line(decode_endpoint).line() if decode_endpoint else self.priors.decode_prefill
            handoff = self._handoff.line()
        tokens = max(0, uncached_tokens)
        decode_only = decode.at(tokens)
        stall = decode_only if streams > 0 else 0.0
        return RouteCosts(decode_only, handoff.at(tokens), stall, decode.ms_per_token * tokens, max(0, streams))

    def probe_due(self, decode_endpoint: str) -> bool:
        """Whether a call that would go decode-only on ``decode_endpoint`` but for its predicted
        time goes anyway, as a trial: every other such call while the endpoint has too few
        decode-only timings, then one in ``PROBE_EVERY``. Counted, not drawn: a prior, or a
        line gone stale, never keeps decode-only from being measured."""
        with self._lock:
            line = self._decode_line(decode_endpoint)
            asked = self._asked[decode_endpoint] = self._asked.get(decode_endpoint, 0) + 1
            return asked % (2 if len(line) < self.priors.min_samples else PROBE_EVERY) == 1

    def choose_dispatch(self, prefill_endpoint: str, prefill_tokens: int, now: float) -> DispatchChoice:
        """Sequential or concurrent for a handoff on ``prefill_endpoint`` (``DispatchChooser``)."""
        with self._lock:
            return self._dispatch.choose(prefill_endpoint, prefill_tokens, now)


__all__ = ["CostModel", "RouteCosts"]
