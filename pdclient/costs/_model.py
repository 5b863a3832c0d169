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
  multi-turn benchmark), the step and the server's own work on the request included;
- **what that stall is a share of**: the answer time of the streams on a decode endpoint
  (their first token to their last, the median of the last whole answers there): a stall
  of S ms on an answer that streams for D ms adds S/D to its time per output token, so a
  budget given as a share of D holds the streams' TPOT on any machine
  (``conversations.ConversationSettings.max_decode_stall_share``).

Every line is a robust fit (``CostLine``: medians over a bounded window), so one call
stuck in a queue does not swing the route, and two processes that saw the same traffic
predict alike. Thread-safe: one lock around all of it.
"""

from __future__ import annotations

import statistics
import threading
from collections import OrderedDict, deque
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
    answer_ms: float
    """The answer time of a stream on that decode endpoint, its first token to its last
    (``CostModel.answer_ms``): what a stall there is a share of."""
    charged_ms: float = 0.0
    """What the decode-only turns admitted there already make the most stalled running stream
    wait (``pools.StallLedger``): the budget bounds it and ``stall_ms`` together."""


class _DecodeEndpoint:
    """What is learnt of one decode endpoint: its prefill line, its streams' answer times,
    and the calls that asked whether decode-only is due a trial there."""

    __slots__ = ("answers", "asked", "line")

    def __init__(self, line: CostLine, window: int) -> None:
        self.line = line
        self.answers: deque[float] = deque(maxlen=window)
        self.asked = 0

    def answer_samples(self, priors: CostPriors) -> int:
        """The answers ``answer_ms`` is the median of (0: fewer than ``min_samples``, the prior's)."""
        return len(self.answers) if len(self.answers) >= priors.min_samples else 0

    def answer_ms(self, priors: CostPriors) -> float:
        """The median of the last whole answers' times (the prior's until ``min_samples``)."""
        return statistics.median(self.answers) if self.answer_samples(priors) else priors.answer_ms


class CostModel:
    """Per-endpoint lines learnt from live calls, and the predictions made from them."""

    def __init__(self, priors: CostPriors | None = None) -> None:
        self.priors = priors or CostPriors()
        self._decode: OrderedDict[str, _DecodeEndpoint] = OrderedDict()
        self._handoff = self._new_line(self.priors.handoff)
        self._dispatch = DispatchChooser(self.priors)
        self._lock = threading.Lock()

    def _new_line(self, prior: Line) -> CostLine:
        return CostLine(prior, window=self.priors.window, min_samples=self.priors.min_samples)

    def _decode_endpoint(self, endpoint: str) -> _DecodeEndpoint:
        learnt = self._decode.get(endpoint)
        if learnt is None:
            line = self._new_line(self.priors.decode_prefill)
            learnt = self._decode[endpoint] = _DecodeEndpoint(line, self.priors.window)
            while len(self._decode) > _MAX_ENDPOINTS:
                self._decode.popitem(last=False)
        self._decode.move_to_end(endpoint)
        return learnt

    # -- learning ------------------------------------------------------------------------

    def learn(self, cost: CallCost) -> None:
        """What a finished call teaches: the line of the route it took, and its answer's time."""
        if cost.answer_ms is not None:
            self.answer(cost.decode_url, cost.answer_ms)
        if cost.prefill_url is None:
            self.decode_only(cost.decode_url, cost.tokens, cost.first_token_ms)
        elif cost.dispatch is not None:
            self.handoff(cost.prefill_url, cost.dispatch, cost.tokens, cost.first_token_ms)

    def decode_only(self, endpoint: str, uncached_tokens: int, ttft_ms: float) -> None:
        """A decode-only call on ``endpoint``: the tokens it computed and its time to first token."""
        with self._lock:
            self._decode_endpoint(endpoint).line.add(uncached_tokens, ttft_ms)

    def answer(self, endpoint: str, answer_ms: float) -> None:
        """A whole answer streamed from the decode endpoint ``endpoint``: its first token to its last."""
        if not 0 <= answer_ms < float("inf"):
            return  # not a measurement: a clock that went back
        with self._lock:
            self._decode_endpoint(endpoint).answers.append(answer_ms)

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
            return self._decode_endpoint(endpoint).line.line()

    def answer_ms(self, endpoint: str) -> float:
        """The answer time of a stream on the decode endpoint ``endpoint``, its first token to
        its last: the median of its last whole answers (the prior's before ``min_samples``)."""
        with self._lock:
            return self._decode_endpoint(endpoint).answer_ms(self.priors)

    def lines(self) -> list[tuple[str, str, Line]]:
        """What ``auto`` decides with now, as ``(line, endpoint, Line)``: each decode endpoint's
        prefill line (``"decode_prefill"``) and its streams' answer time (``"answer"``, as
        a line's fixed step), and the handoff line over every handoff (``"handoff"``,
        endpoint ``""``), priors included; for a scrape (``metrics``)."""
        lines: list[tuple[str, str, Line]] = []
        with self._lock:
            for endpoint, learnt in self._decode.items():
                lines.append(("decode_prefill", endpoint, learnt.line.line()))
                answer = Line(learnt.answer_ms(self.priors), 0.0, learnt.answer_samples(self.priors))
                lines.append(("answer", endpoint, answer))
            return [*lines, ("handoff", "", self._handoff.line())]

    def handover(self, prefill_endpoint: str | None = None, dispatch: str | None = None) -> Line:
        """The handoff line: over every handoff, or one prefill endpoint's in one dispatch mode."""
        with self._lock:
            if prefill_endpoint is None or dispatch is None:
                return self._handoff.line()
            return self._dispatch.line(prefill_endpoint, dispatch)

    def predict(
        self, decode_endpoint: str | None, uncached_tokens: int, streams: int, charged_ms: float = 0.0
    ) -> RouteCosts:
        """Each route's cost for a call of ``uncached_tokens`` whose conversation is held on
        ``decode_endpoint`` (None: no endpoint known, its prior), with ``streams`` running there,
        the most stalled of them already charged ``charged_ms`` (``RouteCosts.charged_ms``)."""
        with self._lock:
            if decode_endpoint:
                learnt = self._decode_endpoint(decode_endpoint)
                decode, answer_ms = learnt.line.line(), learnt.answer_ms(self.priors)
            else:
                decode, answer_ms = self.priors.decode_prefill, self.priors.answer_ms
            handoff = self._handoff.line()
        tokens = max(0, uncached_tokens)
        decode_only = decode.at(tokens)
        stall = decode_only if streams > 0 else 0.0
        compute = decode.ms_per_token * tokens
        charged = charged_ms if streams > 0 and 0 < charged_ms < float("inf") else 0.0
        return RouteCosts(decode_only, handoff.at(tokens), stall, compute, max(0, streams), answer_ms, charged)

    def probe_due(self, decode_endpoint: str) -> bool:
        """Whether a call that would go decode-only on ``decode_endpoint`` but for its predicted
        time goes anyway, as a trial: every other such call while the endpoint has too few
        decode-only timings, then one in ``PROBE_EVERY``. Counted, not drawn: a prior, or a
        line gone stale, never keeps decode-only from being measured."""
        with self._lock:
            learnt = self._decode_endpoint(decode_endpoint)
            learnt.asked += 1
            return learnt.asked % (2 if len(learnt.line) < self.priors.min_samples else PROBE_EVERY) == 1

    def choose_dispatch(self, prefill_endpoint: str, prefill_tokens: int, now: float) -> DispatchChoice:
        """Sequential or concurrent for a handoff on ``prefill_endpoint`` (``DispatchChooser``)."""
        with self._lock:
            return self._dispatch.choose(prefill_endpoint, prefill_tokens, now)


__all__ = ["CostModel", "RouteCosts"]
