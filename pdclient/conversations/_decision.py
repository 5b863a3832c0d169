"""Whether a call skips the remote prefill: the estimate of what its decode server holds, and the decision on it."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from ..costs import CostModel, RouteCosts
from ..wire import REMOTE_PREFILL_MODES
from ._settings import ConversationSettings

_PRIORS = CostModel()
"""Predicts from the priors alone, for a decision asked without costs."""


class Match(str, enum.Enum):
    """How a call relates to the remembered conversation under its key."""

    EXTENDS_ANSWER = "extends_answer"
    """The previous messages, the streamed answer as the next message, then new ones."""
    EXTENDS_PROMPT = "extends_prompt"
    """The previous messages, then others (the answer edited, or not reusable: tool calls)."""
    UNKNOWN = "unknown"
    """Nothing remembered under this key."""
    EDITED = "edited"
    """The previous messages are not this call's first messages (edited, dropped, reordered)."""
    RESHAPED = "reshaped"
    """Tools, model or template options differ from the previous turn's."""
    ENDPOINT_UNAVAILABLE = "endpoint_unavailable"
    """The decode endpoint that holds the conversation is gone or not admitted."""
    EXTENDS_HISTORY = "extends_history"
    """Read from the call alone: its last assistant message ends what the conversation's
    decode endpoint computed (a turn this process did not see: another replica's or
    worker's, or one older than what it remembers)."""
    UNSEEN_HISTORY = "unseen_history"
    """As ``EXTENDS_HISTORY``, but more of the history than this memory saw answered would
    count as cached than ``ConversationSettings.unseen_history_tokens``: only that much does
    (a history made up by the caller, say a long document and an answer no server wrote)."""


@dataclass(frozen=True)
class Estimate:
    """What a call would cost the decode endpoint that holds its conversation."""

    total_tokens: int
    uncached_tokens: int
    endpoint: str | None
    """The decode endpoint whose prefix cache holds the rest; None when nothing is cached."""
    match: Match
    adds_media: bool = False
    """The call's new messages carry a part other than text (an image, audio, video, a
    file, ...): its tokens are what the server's encoder makes of it, which nothing in the
    request tells (``uncached_tokens`` counts the part's JSON, a URL's ~35 tokens)."""
    cache_source: str = "estimate"
    """What said how much is cached: ``"kv_events"``, the decode endpoint's own KV events
    (``pdclient.kv_events``) about the conversation's known token ids, or ``"estimate"``,
    the memory's estimate alone (no events, a view not current, no ids known)."""

    @property
    def cached_tokens(self) -> int:
        return self.total_tokens - self.uncached_tokens


CACHE_SOURCES = ("kv_events", "estimate")


class Reason(str, enum.Enum):
    """Why ``decide_remote_prefill`` chose as it did (machine-readable, for traces and metrics)."""

    MODE_ALWAYS = "mode_always"
    MODE_NEVER = "mode_never"
    NO_ESTIMATE = "no_estimate"
    UNCACHED_AT_OR_ABOVE_THRESHOLD = "uncached_at_or_above_threshold"
    """The operator's fixed cap (``threshold_tokens``, off by default)."""
    UNCACHED_RATIO_AT_OR_ABOVE = "uncached_ratio_at_or_above"
    ADDS_MEDIA = "adds_media"
    STALL_OVER_BUDGET = "stall_over_budget"
    """Decode-only would make the decode's running streams wait longer than the stall budget
    (``ConversationSettings.stall_budget_ms``: a share of their answer's time, or a fixed ms),
    with what the turns admitted while they ran already make them wait."""
    HANDOFF_FASTER = "handoff_faster"
    """The handoff's predicted time to first token is no higher (a tie spares the decode's streams)."""
    DECODE_ONLY_FASTER = "decode_only_faster"
    """Decode-only's predicted time to first token is the lower, within the stall budget."""
    PROBE = "probe"
    """Decode-only although predicted the slower, within the stall budget: its trial on that
    decode endpoint (``costs.CostModel.probe_due``), so that its time is measured, not assumed."""


@dataclass(frozen=True)
class Decision:
    remote_prefill: bool
    reason: Reason
    decode_endpoint: str | None
    """Where the decode leg should go when it is admitted: the endpoint holding the
    conversation. Also on the P/D path, where it pulls only the blocks it lacks."""
    estimate: Estimate | None = None
    costs: RouteCosts | None = None
    """``auto``: each route's predicted cost, on which it decided (None: decided before costs)."""
    stall_budget_ms: float | None = None
    """``auto``: what decode-only could make the decode's running streams wait, in ms
    (``ConversationSettings.stall_budget_ms``; None: decided before costs)."""


def decide_remote_prefill(
    mode: str,
    estimate: Estimate | None,
    settings: ConversationSettings,
    costs: RouteCosts | None = None,
    probe: Callable[[], bool] | None = None,
) -> Decision:
    """Whether a call gets a remote prefill.

    ``always``: every call (pdclient's behaviour before conversations were remembered). ``never``: none, every
    call decode-only. ``auto``: the route with the lower predicted time to first token
    (``costs``, from ``costs.CostModel``; the model's priors when None, with no streams
    running), but a handoff whenever decode-only would stall the decode's running streams
    longer than the stall budget (``ConversationSettings.stall_budget_ms`` of their answer's
    time, ``RouteCosts.answer_ms``), counting what the decode-only turns admitted while they
    ran already stall them (``RouteCosts.charged_ms``): the reason to disaggregate at all. Also a handoff:
    a call with ``max_uncached_ratio`` of its prompt uncached, as Dynamo's conditional
    disaggregation (a conversation's first turn: nothing of it is anywhere), and one at or
    above ``threshold_tokens`` when an operator sets that fixed cap (llm-d's and
    vllm-router's rule). A call whose new messages add media (``Estimate.adds_media``) is
    a handoff whatever its count: an image is hundreds to thousands of tokens, and the
    vision encoder's work with them, that only the server can count, and a decode-only
    call would make the decode server do it all while its other streams stall.
    ``probe``: asked only when nothing but the predicted time stands in the way of
    decode-only, for a call whose compute would be within the budget even if streams ran;
    True sends the call decode-only all the same, as a trial (``Reason.PROBE``).
    """
    endpoint = estimate.endpoint if estimate is not None else None
    if mode == "always":
        return Decision(True, Reason.MODE_ALWAYS, endpoint, estimate)
    if mode == "never":
        return Decision(False, Reason.MODE_NEVER, endpoint, estimate)
    if mode != "auto":
        raise ValueError(f"remote_prefill must be one of {REMOTE_PREFILL_MODES}, got {mode!r}")
    if estimate is None:
        return Decision(True, Reason.NO_ESTIMATE, None, None)
    if estimate.adds_media:
        return Decision(True, Reason.ADDS_MEDIA, endpoint, estimate)
    if costs is None:
        costs = _PRIORS.predict(None, estimate.uncached_tokens, streams=0)
    budget = settings.stall_budget_ms(costs.answer_ms)

    def decided(remote_prefill: bool, reason: Reason) -> Decision:
        return Decision(remote_prefill, reason, endpoint, estimate, costs, budget)

    if settings.threshold_tokens is not None and estimate.uncached_tokens >= settings.threshold_tokens:
        return decided(True, Reason.UNCACHED_AT_OR_ABOVE_THRESHOLD)
    total = max(estimate.total_tokens, 1)
    if estimate.uncached_tokens / total >= settings.max_uncached_ratio:
        return decided(True, Reason.UNCACHED_RATIO_AT_OR_ABOVE)
    if costs.stall_ms > 0 and costs.charged_ms + costs.stall_ms > budget:
        return decided(True, Reason.STALL_OVER_BUDGET)
    if costs.decode_only_ms < costs.handoff_ms:
        return decided(False, Reason.DECODE_ONLY_FASTER)
    # A trial only of a call whose compute would be within the budget had streams been running:
    # the larger of the learnt one and the one a fleet starts with, since answers that take
    # next to no time (one token, a tool call) would otherwise stop decode-only being measured.
    trial_budget = max(budget, settings.stall_budget_ms(_PRIORS.priors.answer_ms))
    if endpoint is not None and costs.compute_ms <= trial_budget and probe is not None and probe():
        return decided(False, Reason.PROBE)
    return decided(True, Reason.HANDOFF_FASTER)
