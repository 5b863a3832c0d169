"""Whether a call gets a remote prefill (``remote_prefill``), and what its conversation teaches.

``always``: yes. ``never``: no, the caller's body goes to a routed decode endpoint.
``auto``: a chat call is estimated against the conversation its affinity key names
(``ConversationMemory``, one per fleet) and goes decode-only, to the decode endpoint that
answered the previous turn, when ``decide_remote_prefill`` says its prefix is cached
there; a completions call (nothing remembered) gets its prefill. Around the call, its
``ConversationTurn`` reads the conversation once, teaches the memory the servers' own
token counts, and remembers a whole answer as the next turn's prefix. ``RemotePrefill``
holds one call's part in all this, from the decision to the answer remembered.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import httpx
import orjson

from .. import wire
from .._options import DEFAULT_ROUTING, PDOptions
from .._trace import CostDecision, Outcome
from ..conversations import (
    SHAPE_FIELDS,
    AnswerCollector,
    ConversationMemory,
    ConversationSettings,
    Decision,
    Estimate,
    HeldTokens,
    Match,
    Reason,
    decide_remote_prefill,
    rendered_chars,
)
from ..costs import CallCost, DispatchChoice
from ..kv_events import KVEventFeeds, turn_keys
from ..migration import Tracker
from ..pools import AllEndpointsOpen, EndpointPool, StallLedger
from ..routing import RouteDecision, RouteRequest, conversation_routing, policy_decision
from ._leg import Leg
from ._leg_requests import LegRequests
from ._prompt_ids import forwardable, tokenize_request
from ._record import CallRecord
from ._report import STORED_STATE

if TYPE_CHECKING:
    from ..dialects import Dialect
    from ..fleet import Fleet


class HandoffInstead(Exception):
    """Raised by ``Call.decode_request``: the decode-only call becomes a P/D handoff (its
    conversation's endpoint is out of reach); the transport runs the prefill, then the decode."""


def conversation_home(pool: EndpointPool, options: PDOptions, route: RouteRequest) -> RouteDecision | None:
    """The decode endpoint a conversation's turns go to in every process (rendezvous on its
    affinity key, with a load bound: ``routing.Rendezvous``); None if none is admitted, or
    when the decode leg's own policy places it (this process's memory then finds it)."""
    chosen = options.decode_routing is not None or options.routing != DEFAULT_ROUTING
    policy = conversation_routing(pool.policy, chosen=chosen)
    if policy is None:
        return None
    try:
        return policy_decision(policy, pool.candidates(), route)
    except AllEndpointsOpen:
        return None


def decode_streams(pool: EndpointPool, url: str | None, now: float) -> tuple[int, StallLedger | None]:
    """The streams running on the decode endpoint ``url``, and its ledger of this process's
    (``Endpoint.stalls``; None: not in the pool). Counted: this process's calls whose answer
    has begun there (a call still waiting for its first token pays a decode-only turn's
    prefill in its time to first token, not between tokens), or the server's own count when a
    fresh load sample says more (other processes')."""
    for endpoint in pool.endpoints:
        if endpoint.url == url:
            load = endpoint.load
            counted = int(load.running) if load is not None and load.fresh(now) else 0
            return max(endpoint.streaming, counted), endpoint.stalls
    return 0, None


def remote_prefill_decision(
    mode: str,
    estimate: Estimate | None,
    settings: ConversationSettings,
    home: RouteDecision | None,
    fleet: Fleet | None = None,
) -> Decision:
    """``decide_remote_prefill`` on the costs ``fleet`` learnt (``Fleet.costs``) for the
    decode endpoint holding the conversation, its decode endpoint the conversation's home
    when the memory names none: every replica sends this conversation's turns to the same
    decode endpoint. A call sent decode-only there charges its predicted stall to the
    streams running there (``pools.StallLedger``), which the next calls' budget counts."""
    costs, probe, stalls = None, None, None
    if mode == "auto" and estimate is not None and fleet is not None:
        held = estimate.endpoint or (home.endpoint.url if home is not None else None)
        streams, stalls = decode_streams(fleet.decode, held, time.monotonic())
        charged = stalls.most_charged_ms() if stalls is not None else 0.0
        costs = fleet.costs.predict(held, estimate.uncached_tokens, streams, charged)
        if held is not None:
            probe = functools.partial(fleet.costs.probe_due, held)
    decision = decide_remote_prefill(mode, estimate, settings, costs, probe)
    if stalls is not None and costs is not None and not decision.remote_prefill:
        stalls.charge(costs.stall_ms)
    if decision.decode_endpoint is None and home is not None:
        decision = dataclasses.replace(decision, decode_endpoint=home.endpoint.url)
    return decision


def handoff_after_all(decision: Decision, settings: ConversationSettings) -> Decision:
    """The decision for a call sent decode-only to the endpoint holding its conversation that
    cannot go there (it stopped admitting, or its attempt failed): on any other decode
    endpoint nothing of the conversation is cached, so the call becomes a P/D handoff, as
    ``auto`` decides for a conversation whose endpoint is unavailable."""
    estimate = decision.estimate
    if estimate is not None:
        total = estimate.total_tokens
        estimate = Estimate(total, total, None, Match.ENDPOINT_UNAVAILABLE)
    after_all = decide_remote_prefill("auto", estimate, settings)
    if not after_all.remote_prefill:  # a prompt estimated at no tokens at all
        return Decision(True, Reason.UNCACHED_RATIO_AT_OR_ABOVE, None, estimate)
    return after_all


def pin_decode(leg: Leg, held: str | None, home: RouteDecision | None, stored_at: str | None) -> str | None:
    """The endpoint a decode's first attempt is pinned to, if it admits (later attempts are
    routed): a decode-only call's goes to the endpoint holding its conversation (``held``);
    a handoff's to the conversation's rendezvous endpoint (``home``), so the next turn finds
    it from any process; a stored response's to the endpoint that stored it (``stored_at``:
    one no longer in the pool leaves the call routed as any other, and that server answers)."""
    if leg.attempt:
        return None
    if held is not None:
        return leg.pin(held, "held")
    if home is not None:
        return leg.pin(home.endpoint.url, home.rule or "key", home.policy)
    if stored_at is not None:
        return leg.pin(stored_at, STORED_STATE)
    return None


class ConversationTurn:
    """One chat call's turn of its conversation, as the memory sees it: the fields it reads
    (once), the estimate, what the servers' own counts teach it, and the answer to remember."""

    __slots__ = ("_body", "collector", "held", "memory", "plan")

    def __init__(self, plan: wire.Plan, memory: ConversationMemory, held: HeldTokens | None = None) -> None:
        self.plan = plan
        self.memory = memory
        self.held = held
        """What the endpoints' KV events say they hold (``Fleet.kv_events``), None without them."""
        self.collector = AnswerCollector(stream=plan.stream)
        """The answer the caller receives, from the decode body's bytes (``CallerBody``)."""
        self._body: dict[str, Any] | None = None

    def body(self) -> dict[str, Any]:
        """The fields ``ConversationMemory`` reads of this chat call: its messages and its shape."""
        if self._body is None:
            body: dict[str, Any] = {}
            for name in SHAPE_FIELDS:  # read when the call was planned (Call.plan_or_refuse): readable
                if name in self.plan.fields:
                    body[name] = wire.field_value(self.plan.fields, name)
            body["messages"] = self.plan.messages
            self._body = body
        return self._body

    def estimate(self, admitted: list[str], home: RouteDecision | None) -> Estimate:
        """What the call would cost on the decode endpoint holding it, among those ``admitted``."""
        # The rendezvous endpoint holds the conversation only when no load moved it there.
        held = home.endpoint.url if home is not None and home.rule == "key" else None
        return self.memory.estimate(
            self.plan.affinity_key, self.body(), admitted, held, tenant=self.plan.tenant, held=self.held
        )

    def learn(self, prompt_tokens: int) -> None:
        """The chars-per-token ratio ``auto``'s estimates of the caller's tenant use, from a server's own count."""
        self.memory.learn(self.body(), prompt_tokens, tenant=self.plan.tenant)

    def remember(
        self,
        decision: Decision,
        endpoint: str,
        *,
        decode_only: bool,
        prefill_tokens: int | None,
        prefill_ids: bytes | None = None,
        decoded: Tracker | None = None,
    ) -> None:
        """A whole answer of a call that went as planned: the next turn's prefix on ``endpoint``.

        ``prefill_tokens``: the prompt's length as the prefill's ids counted it (None: the
        decode's ``usage.prompt_tokens``, when it reported one). ``prefill_ids``: those ids'
        JSON array, kept as chain keys when the endpoints' KV events are read, with the
        answer's ids (and without a prefill, the prompt's) the decode leg sent (``decoded``)."""
        collector = self.collector
        answer = collector.answer()
        if answer is None:
            return
        prompt_tokens = prefill_tokens if prefill_tokens is not None else collector.prompt_tokens
        floor = decision.estimate.cached_tokens if decision.estimate is not None else 0
        if decode_only and collector.prompt_tokens is not None:
            # The decode server's own count of this prompt: the chars-per-token ratio learns
            # from it as from a prefill's, and what it found cached is the floor that counts.
            self.learn(collector.prompt_tokens)
            if collector.cached_tokens is not None:
                floor = collector.cached_tokens
        keys, answer_keyed = self._known_keys(prefill_ids, decoded)
        self.memory.remember(
            self.plan.affinity_key,
            self.body(),
            answer,
            endpoint,
            prompt_tokens=prompt_tokens,
            cached_floor=floor,
            prompt_pulled=not decode_only,
            prompt_keys=keys,
            answer_keyed=answer_keyed,
        )

    def _known_keys(self, prefill_ids: bytes | None, decoded: Tracker | None) -> tuple[bytes, bool]:
        """The chain keys of the prompt's ids (the prefill's, else the decode's), packed, and
        whether they go on through the answer's; none without KV events or ids.

        The answer's last id is left out: the decode sampled it and never computed its KV,
        so no server holds a block that ends with it."""
        if self.held is None:
            return b"", False
        if prefill_ids is not None:
            prompt: list[int] = orjson.loads(prefill_ids)
        elif decoded is not None and decoded.prompt_ids is not None:
            prompt = decoded.prompt_ids
        else:
            return b"", False
        answer = decoded.ids if decoded is not None and decoded.answered else []
        return turn_keys(prompt, answer, self.memory.settings.block_size), bool(answer)


class RemotePrefill:
    """One call's remote prefill: whether it gets one and why, the conversation it belongs
    to, the stored state it builds on, the warm-up it queued. Decided once after planning;
    a decode-only call whose conversation's endpoint is out of reach becomes a handoff after
    all; a whole answer is remembered at the call's end."""

    __slots__ = (
        "_estimate",
        "_prepared",
        "_tokens",
        "conversation",
        "decision",
        "forwarded_ids",
        "home",
        "prompt_ids",
        "stored_state",
        "tokenize_ms",
        "warm_up_url",
    )

    def __init__(self) -> None:
        self.decision: Decision | None = None
        """Whether the call gets a remote prefill, and why (None: not decided, or a stored state)."""
        self.conversation: ConversationTurn | None = None
        """The call's turn of its conversation (chat, ``remote_prefill`` not ``always``)."""
        self.home: RouteDecision | None = None
        """The conversation's decode endpoint by rendezvous, the same in every process."""
        self.stored_state: str | None = None
        """The field naming server-stored state the call builds on (``Dialect.stored_state``): decode-only."""
        self.warm_up_url: str | None = None
        """The prefill endpoint this decode-only call's prompt was queued to (``fleet._warm``)."""
        self._tokens: int | None = None
        self._estimate: Estimate | None = None
        self._prepared = False
        self.tokenize_ms: float | None = None
        """How long the prefill server's /tokenize of the call's prompt took (``_prompt_ids``);
        None when it was not asked."""
        self.prompt_ids: list[int] | None = None
        """The call's prompt ids that /tokenize gave (None: not asked, or it failed)."""
        self.forwarded_ids: wire.PrefillResult | None = None
        """Those ids as the decode-only leg took them (``tokenized_prompt``), for the trace."""

    def prepare(
        self,
        plan: wire.Plan,
        mode: str,
        dialect: Dialect,
        options: PDOptions,
        fleet: Fleet,
        route_for: Callable[[str], RouteRequest],
    ) -> None:
        """Once after planning: the stored state the call builds on, or its conversation,
        that conversation's home and the estimate ``auto`` decides on. ``route_for``: what
        a leg's policy may know of the call, asked only for a conversation's home."""
        if self._prepared:
            return
        self._prepared = True
        self.stored_state = dialect.stored_state(plan)
        if self.stored_state is not None:
            return  # the state is where it was stored, never on a prefill server
        if mode != "always" and plan.messages is not None:  # a conversation, in chat messages
            held = fleet.kv_events.held_tokens if fleet.kv_events is not None else None
            self.conversation = ConversationTurn(plan, fleet.memory, held)
            self.home = conversation_home(fleet.decode, options, route_for("decode"))
        if mode == "auto" and self.conversation is not None:
            self._estimate = self.conversation.estimate([e.url for e in fleet.decode.admitted()], self.home)

    def wants_prompt_ids(self) -> bool:
        """Whether the call's prompt ids are worth a /tokenize before deciding (``_prompt_ids``)."""
        turn, estimate = self.conversation, self._estimate
        return turn is not None and estimate is not None and turn.memory.wants_prompt_ids(estimate, turn.held)

    def tokenize_request(
        self, prefill: EndpointPool, route_for: Callable[[str], RouteRequest], caller: httpx.Request, request_id: str
    ) -> httpx.Request | None:
        """A prefill server's /tokenize of the call's prompt, when ``auto`` would decide on a
        history no one here saw and the decode's events can say how much of it is held
        (``_prompt_ids``); None otherwise (``prepare`` first)."""
        if self.conversation is None or not self.wants_prompt_ids():
            return None
        try:
            endpoint = prefill.decide(route_for("prefill")).endpoint
        except AllEndpointsOpen:
            return None
        return tokenize_request(self.conversation.plan, endpoint.url, caller, request_id)

    def prefilled(self, result: wire.PrefillResult) -> None:
        """The prefill's answer: its servers' own token count teaches the conversation's estimate."""
        if self.conversation is not None and result.ids is not None:
            self.conversation.learn(result.count)

    def held_by(self, pool: EndpointPool, feeds: KVEventFeeds | None) -> dict[str, int] | None:
        """How much of the conversation's known ids each endpoint of ``pool`` holds, by its
        KV events, for a policy that follows a prefix cache; None when nothing says."""
        turn = self.conversation
        if turn is None or feeds is None:
            return None
        keys = turn.memory.known_keys(turn.plan.affinity_key, turn.body())
        if not keys:
            return None
        block = turn.memory.settings.block_size
        return {e.url: feeds.held_tokens(e.url, keys, block) or 0 for e in pool.endpoints}

    def use_prompt_ids(self, token_ids: list[int] | None, elapsed_ms: float) -> None:
        """The prompt's ids (None: the tokenize failed) count what the decode holds of it."""
        self.tokenize_ms = elapsed_ms
        self.prompt_ids = token_ids
        turn, estimate = self.conversation, self._estimate
        if token_ids is not None and turn is not None and turn.held is not None and estimate is not None:
            self._estimate = turn.memory.with_prompt_ids(estimate, token_ids, turn.held)

    def tokenized_prompt(self, plan: wire.Plan) -> wire.PrefillResult | None:
        """The ids /tokenize gave, for a decode-only call's decode leg to take as a handoff's
        takes the prefill's (its body built by the same code: ``wire.decode_fields``), when
        they are exactly what the decode would render (``forwardable``); None otherwise."""
        decision, ids = self.decision, self.prompt_ids
        self.forwarded_ids = None
        if ids is not None and decision is not None and not decision.remote_prefill and forwardable(plan):
            self.forwarded_ids = wire.PrefillResult(orjson.dumps(ids), len(ids), None)
        return self.forwarded_ids

    def decide(
        self,
        plan: wire.Plan,
        mode: str,
        dialect: Dialect,
        options: PDOptions,
        fleet: Fleet,
        route_for: Callable[[str], RouteRequest],
        requests: LegRequests,
    ) -> bool:
        """Whether the call gets a prefill leg (``prepare`` first, if it was not); a decode-only
        call's prompt queued for a warm-up (``warm_up``). ``route_for``: what a leg's policy
        may know of the call, asked only for a conversation's home and a warm-up's prefill
        endpoint."""
        self.prepare(plan, mode, dialect, options, fleet, route_for)
        if self.stored_state is not None:
            return False
        estimate = self._estimate
        self.decision = remote_prefill_decision(mode, estimate, options.conversations, self.home, fleet)
        if not self.decision.remote_prefill and mode == "auto" and options.conversations.warm_prefill:
            self.warm_up(fleet, route_for("prefill"), requests, dialect.warm_up_body(plan))
        return self.decision.remote_prefill

    def warm_up(self, fleet: Fleet, prefill_route: RouteRequest, requests: LegRequests, body: bytes) -> None:
        """Queue a decode-only call's prompt (``body``) for the prefill endpoint its
        conversation's P/D turns are routed to, so that a later one prefills only what is new."""
        try:
            endpoint = fleet.prefill.decide(prefill_route).endpoint
        except AllEndpointsOpen:
            return  # no prefill endpoint admitted: nothing to keep warm
        fleet.warm(endpoint, requests.warm_up(endpoint, body))
        self.warm_up_url = endpoint.url

    def pin_decode(self, leg: Leg, stored_at: str | None, settings: ConversationSettings) -> str | None:
        """The endpoint the decode's first attempt is pinned to (``pin_decode``), if any.

        Raises ``HandoffInstead`` when a decode-only call's conversation endpoint is out of
        reach: its decision becomes a handoff after all (``handoff_after_all``)."""
        decision = self.decision
        held = decision.decode_endpoint if decision is not None and not decision.remote_prefill else None
        pinned = pin_decode(leg, held, self.home, stored_at)
        if held is not None and pinned is None:
            assert decision is not None
            self.decision = handoff_after_all(decision, settings)
            raise HandoffInstead
        return pinned

    @property
    def keys_answer(self) -> bool:
        """The call's decode leg asks for its ids (``return_token_ids``; the caller never sees
        them unless it asked): its conversation's turn is keyed for the KV events."""
        return self.conversation is not None and self.conversation.held is not None

    def ended(
        self,
        plan: wire.Plan | None,
        record: CallRecord,
        prefill: wire.PrefillResult | None,
        fleet: Fleet,
        *,
        decode_url: str,
        prefill_url: str | None,
    ) -> None:
        """What a call that ended whole on ``decode_url`` (after a prefill on ``prefill_url``,
        if any) teaches: its conversation remembers the answer, the cost model learns its
        time to first token (``CallRecord.first_token_ms``)."""
        self._remember(record, decode_url, prefill)
        cost = self._cost(plan, record, decode_url, prefill_url, fleet.memory)
        if cost is not None:
            fleet.costs.learn(cost)

    def _remember(self, record: CallRecord, endpoint: str, prefill: wire.PrefillResult | None) -> None:
        """The whole answer ``endpoint`` gave a call that went as planned: its conversation's
        next prefix there (a failed or fallback call's answer teaches nothing), keyed with the
        ids its decode leg sent (``CallRecord.decoded``), when it was asked for them."""
        turn, decision, outcome = self.conversation, self.decision, record.outcome
        if turn is None or decision is None or outcome not in (Outcome.DISAGGREGATED, Outcome.DECODE_ONLY):
            return
        ids = prefill.ids if prefill is not None else None
        counted = prefill.count if prefill is not None and ids is not None else None
        decode_only = outcome is Outcome.DECODE_ONLY
        turn.remember(
            decision, endpoint, decode_only=decode_only, prefill_tokens=counted, prefill_ids=ids, decoded=record.decoded
        )

    def handoff_tokens(self, plan: wire.Plan, memory: ConversationMemory) -> int:
        """The tokens a handoff's prefill computes, as the costs count them: the estimate's
        uncached tokens, else the prompt's text read with the tenant's learned ratio. Read
        once: the dispatch choice and what the call teaches count alike (the prefill's own
        count is known only after the choice)."""
        if self._tokens is None:
            estimate = self.decision.estimate if self.decision is not None else None
            if estimate is not None:
                self._tokens = estimate.uncached_tokens
            elif plan.messages is not None:
                chars = rendered_chars(plan.messages, wire.field_value(plan.fields, "tools"))
                self._tokens = memory.tokens_for(chars, len(plan.messages) + 1, tenant=plan.tenant)
            else:  # completions: the prompt field's length as sent, unparsed (it may be long)
                self._tokens = memory.tokens_for(len(plan.fields.get("prompt") or b""), 0, tenant=plan.tenant)
        return self._tokens

    def _cost(
        self,
        plan: wire.Plan | None,
        record: CallRecord,
        decode_url: str,
        prefill_url: str | None,
        memory: ConversationMemory,
    ) -> CallCost | None:
        """What a whole streamed call teaches the cost model: its time to first token on the
        route it took, against the tokens computed for it (a decode-only call: the decode's
        own count of what it found uncached where it says, else the estimate; a handoff:
        ``handoff_tokens``), and its answer's time when its conversation saw the answer end
        (``AnswerCollector.whole``: a stream the caller closed early says nothing of it)."""
        first_token_ms, outcome = record.first_token_ms, record.outcome
        if first_token_ms is None or plan is None:
            return None
        collector = self.conversation.collector if self.conversation is not None else None
        answer_ms = record.answer_ms if collector is not None and collector.whole else None
        if outcome is Outcome.DECODE_ONLY and self.stored_state is None:
            estimate = self.decision.estimate if self.decision is not None else None
            tokens = estimate.uncached_tokens if estimate is not None else None
            if collector is not None and collector.prompt_tokens is not None and collector.cached_tokens is not None:
                tokens = collector.prompt_tokens - collector.cached_tokens
            return CallCost(first_token_ms, decode_url, tokens, answer_ms=answer_ms) if tokens is not None else None
        if outcome is Outcome.DISAGGREGATED and prefill_url and record.dispatch is not None:
            tokens = self.handoff_tokens(plan, memory)
            return CallCost(first_token_ms, decode_url, tokens, prefill_url, record.dispatch, answer_ms)
        return None

    def trace(self, dispatch: str | None, choice: DispatchChoice | None) -> CostDecision | None:
        """The call's ``PDTrace.decision``: the route, why, and each route's predicted cost."""
        decision = self.decision
        if decision is None:
            return None
        costs = decision.costs
        return CostDecision(
            route="handoff" if decision.remote_prefill else "decode_only",
            reason=decision.reason.value,
            decode_only_ms=costs.decode_only_ms if costs is not None else None,
            handoff_ms=costs.handoff_ms if costs is not None else None,
            stall_ms=costs.stall_ms if costs is not None else None,
            streams=costs.streams if costs is not None else None,
            charged_ms=costs.charged_ms if costs is not None else None,
            stall_budget_ms=decision.stall_budget_ms,
            dispatch=dispatch,
            dispatch_reason=choice.reason.value if choice is not None else None,
            sequential_ms=choice.sequential_ms if choice is not None else None,
            concurrent_ms=choice.concurrent_ms if choice is not None else None,
        )
