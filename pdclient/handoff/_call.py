"""One call's state: its plan, its phase, its two legs, and how it ended.

A ``Call`` is made per request by a transport and holds every decision about it; the
transports only move bytes (send a leg, read a body, retry, sleep) and differ by
``await``. Observers see the call and its legs through ``CallView`` / ``LegView``.

    PLANNING --refused--> ENDED                   (400, no server called)
        |  |--no decode endpoint admitted--> ENDED (503 and no prefill; or on to the fallback URL)
        |  '--remote_prefill says decode-only--> DECODE
        v
    PREFILL --fails, policy "fail"--> ENDED       (the prefill's error, or 502/503)
        |  (ok, or failed with policy "decode" / a fallback URL)
        v
    DECODE --no response--> ENDED                 (exception, or 503 when no endpoint is admitted)
        |  '--decode-only, its conversation's endpoint out of reach--> PREFILL (a handoff after all)
        v
    STREAMING --body closed--> ENDED              (whole, abandoned by the caller, or broken)
        |  '--finished answer cut--> ENDED        (ended as the server ended it, never moved)
        '--broke mid-answer, may move--> DECODE   (a continuation on another endpoint, same body)

Pass-through requests go straight to DECODE with their body as sent, once checked for a
``kv_transfer_params`` (a multipart upload is checked as it streams, never read whole).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import orjson

from .._observe import Observers
from .._options import DEFAULT_ROUTING, PDOptions, call_override_refusal
from .._trace import Outcome, PDTrace
from ..conversations import SHAPE_FIELDS, AnswerCollector, Decision, Estimate, Match, Reason, decide_remote_prefill
from ..dialects import Dialect, IdTags, dialect_for, endpoint_for, endpoint_tag, names_a_response, untag_path
from ..fleet import WARM_UP_TIMEOUT, Fetch, Fleet, request_overrides
from ..migration import _core as migrate
from ..pools import AllEndpointsOpen, Endpoint, EndpointPool
from ..pools import _retry as retry
from ..routing import TENANT_EXTENSION, RouteDecision, RouteRequest, conversation_routing, plan_text, policy_decision
from ..wire import (
    CALL_OPTIONS_KEY,
    HOP_BY_HOP,
    PREFILL_FAILURE_POLICIES,
    RAW_TRACE_HEADER_PREFIX,
    SIGNATURE_HEADER,
    redact_url,
    signature,
)
from ..wire import _bodies as wire
from ..wire import _usage as usage
from . import _dispatch

logger = logging.getLogger("pdclient")

STORED_STATE = "stored_state"
"""``PDTrace.remote_prefill_reason`` of a call building on state a decode server stored."""

CALL_RECORD = "pdclient_call"
"""The attribute marking a log record that reports how one call ended (``Call.end``): a
program that logs each call itself (``pdclient serve``) filters these out."""

# Hop-by-hop or derived headers that must not be copied onto a leg's new request (the
# request id is set anew, as the call's).
_DROPPED_REQUEST_HEADERS = HOP_BY_HOP | {b"host", b"content-length", b"x-request-id"}
# How the caller framed its body: kept when its body stream goes on unread (a leg without
# them would declare no body, and h11 refuses to send one).
_BODY_FRAMING = frozenset({b"content-length", b"transfer-encoding"})
_CONTENT_LENGTH = frozenset({b"content-length"})
_READ_BODY_FRAMING = frozenset({b"content-length", b"content-encoding", b"transfer-encoding"})
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})  # httpx declares even an empty one
# The one-token decode that frees an abandoned handoff's KV: bounded, so a caller that
# is going away (Ctrl-C, a cancelled task) waits at most this long for it.
RELEASE_TIMEOUT = 10.0
# A leg that failed so never sent a byte to its server.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
# httpcore's trace event for the first bytes of a request going out (HTTP/1.1 and HTTP/2).
_SENDING = ("http11.send_request_headers.started", "http2.send_request_headers.started")


class _RequestIds:
    """Request ids no other call of any process has: a random 64-bit prefix per process
    (anew in a forked child) and a counter. ``uuid4`` asks the kernel for randomness per
    id, ~0.1 ms each on these machines, a few per cent of the proxy's CPU per call."""

    def __init__(self) -> None:
        self.reset()
        os.register_at_fork(after_in_child=self.reset)

    def reset(self) -> None:
        self._prefix = f"pd-{os.urandom(8).hex()}-"
        self._counter = itertools.count()

    def next(self) -> str:
        return f"{self._prefix}{next(self._counter):x}"


new_request_id = _RequestIds().next


@functools.lru_cache(maxsize=1024)
def leg_url(base: str, path: str, query: bytes) -> httpx.URL:
    """A leg's URL, parsed once per endpoint, path and query (httpx URLs are immutable)."""
    return httpx.URL(base + path, query=query or None)


def request_with_content(
    method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]], content: bytes, extensions: dict[str, Any]
) -> httpx.Request:
    """A request whose body is known, as ``httpx.Request(content=...)`` builds it.

    Given the body as a stream, httpx takes the headers as they are: ``content=`` would
    scan them again for each header it might add (~0.1 ms a request in ``pdclient
    serve``). So ``headers`` are complete but for the length, added here as httpx adds it.
    """
    if content or method in _METHODS_WITH_BODY:
        headers = [*headers, (b"content-length", str(len(content)).encode("ascii"))]
    request = httpx.Request(method, url, headers=headers, stream=httpx.ByteStream(content), extensions=extensions)
    request.read()  # ``request.content`` is there to read, as with ``content=``
    return request


class HandoffInstead(Exception):
    """Raised by ``Call.decode_request``: the decode-only call becomes a P/D handoff (its
    conversation's endpoint is out of reach); the transport runs the prefill, then the decode."""


class Phase(enum.Enum):
    PLANNING = "planning"
    PREFILL = "prefill"
    DECODE = "decode"
    STREAMING = "streaming"
    ENDED = "ended"


@dataclass(frozen=True)
class CallContext:
    """What every call of one transport shares."""

    options: PDOptions
    fleet: Fleet
    observers: Observers


class Leg:
    """One leg of a call (prefill, decode, or the KV release): endpoints tried, the current attempt.

    Observers see it as a ``LegView`` between ``on_leg_start`` and ``on_leg_end``.
    """

    def __init__(self, call: Call, name: str, pool: EndpointPool | None) -> None:
        self._call = call
        self.name = name
        self.pool = pool
        self.tried: list[Endpoint] = []
        self.endpoint: Endpoint | None = None
        self.decision: RouteDecision | None = None
        self.url = ""
        self.attempt = 0
        self.request: httpx.Request = call.request
        self.sent_at = 0.0
        self.status: int | None = None
        self._open = False

    def pick(self, route: RouteRequest, exclude: Sequence[Endpoint] = ()) -> str:
        """An admitted endpoint this call has not tried yet if any, never one in ``exclude``
        (those a moved stream broke on); raises ``AllEndpointsOpen``. The one way a leg takes
        a routed endpoint: the policy's ``on_routed``, the trace and the metrics all see it."""
        assert self.pool is not None
        self.decision = self.pool.decide(route, avoid=self.tried, exclude=exclude)
        endpoint = self.decision.endpoint
        endpoint.acquire()
        self.endpoint = endpoint
        self.tried.append(endpoint)
        self.url = endpoint.url
        return endpoint.url

    def pin(self, url: str, rule: str, policy: str = "conversation") -> str | None:
        """The pool's member at ``url`` if it admits a request now (else None), chosen by the
        call itself: the decode endpoint holding a conversation (``remote_prefill``), or the
        one its rendezvous names (``policy`` ``rendezvous``)."""
        assert self.pool is not None
        for endpoint in self.pool.endpoints:
            if endpoint.url == url and endpoint not in self.tried and endpoint.admits():
                return self.take(RouteDecision(policy, endpoint, rule=rule))
        return None

    def take(self, decision: RouteDecision) -> str:
        """The endpoint ``decision`` names, chosen by the call itself, whatever its breaker says."""
        endpoint = decision.endpoint
        endpoint.acquire()
        self.endpoint = endpoint
        self.tried.append(endpoint)
        self.decision = decision
        self.url = endpoint.url
        return endpoint.url

    def use(self, url: str) -> str:
        """A fixed URL outside any pool (the fallback server)."""
        self.endpoint = self.decision = None
        self.url = url
        return url

    def start(self, request: httpx.Request) -> httpx.Request:
        if self.endpoint is not None and self.endpoint.host_name is not None:
            headers, extensions = request_overrides(self.endpoint)  # a discovered address: its DNS name
            request.headers.update(headers)
            request.extensions = {**request.extensions, **extensions}
        self.attempt += 1
        self.request = request
        self.status = None
        self.sent_at = time.perf_counter()
        self._open = True
        self._call.observers.leg_start(self._call, self)
        return request

    def answered(self, chunks: int = 1) -> None:
        """The answer is whole, in ``chunks`` pieces: the endpoint's latency learns the time per piece."""
        if self.endpoint is not None:
            self.endpoint.latency.observe((time.perf_counter() - self.sent_at) * 1000 / max(1, chunks))

    def end(self, status: int | None, error: BaseException | None) -> None:
        """The attempt is over: free the endpoint (its breaker learns the outcome), tell the observers."""
        if not self._open:
            return
        self._open = False
        self.status = status
        if self.endpoint is not None:
            self.endpoint.release(ok=_health(status, error))
        self._call.observers.leg_end(self._call, self, status, error)


def _health(status: int | None, error: BaseException | None) -> bool | None:
    """What an attempt says of its server: a transport or decoding error counts against it, a cancel does not."""
    if error is not None:
        return False if isinstance(error, httpx.TransportError | httpx.DecodingError) else None
    return retry.counts_against_server(status)


class Call:
    """One request through a P/D transport, from the caller's request to its trace."""

    def __init__(self, context: CallContext, request: httpx.Request) -> None:
        self.context = context
        self.observers = context.observers
        self.request = request
        self.request_id = request.headers.get("x-request-id") or new_request_id()
        tenant = request.extensions.get(TENANT_EXTENSION)
        self.tenant: str | None = None if tenant is None else str(tenant)
        """Who is calling, as the server passing its callers' requests on named them (``TENANT_EXTENSION``)."""
        self.started = time.perf_counter()
        self.data: dict[Any, Any] = {}
        self.phase = Phase.PLANNING
        fleet = context.fleet
        url = str(request.url).partition("?")[0]  # copy_with(query=None) would parse the URL again
        base = fleet.decode.base_of(url)
        self.relative_path = url[len(base) :] if base is not None else ""
        self.dialect: Dialect | None = (
            dialect_for(self.relative_path) if base is not None and request.method == "POST" else None
        )
        """The API this P/D call speaks (``pdclient.dialects``); None for a pass-through."""
        self.stored_tag: str | None = None
        """The decode endpoint's tag the stored response this call names carries (``dialects._stored_state``)."""
        if self.dialect is None and base is not None:
            self.relative_path, self.stored_tag = untag_path(self.relative_path)
        self.id_tags: IdTags | None = None
        """Tags the answer's response ids with its decode endpoint's, on their way to the caller."""
        self.kind = self.dialect.kind if self.dialect is not None else None
        self.route = self.kind.value if self.kind else "passthrough"
        self.plan: wire.Plan | None = None
        self.prefill = Leg(self, "prefill", fleet.prefill)
        self.decode = Leg(self, "decode", fleet.decode)
        self.prefill_result: wire.PrefillResult | None = None
        self.outcome = Outcome.DISAGGREGATED if self.kind else Outcome.PASSTHROUGH
        self.fallback: str | None = None
        self.error: str | None = None
        self.failed_leg: str | None = None
        self.fallback_url: str | None = None
        self.decode_may_have_reached = False
        self.cpu_seconds = 0.0
        self.prefill_ms: float | None = None
        self.decode_headers_ms: float | None = None
        self.decode_first_byte_ms: float | None = None
        self.pass_through_body: bytes | None = None
        """A pass-through JSON body without pdclient's per-call options; None forwards the caller's stream."""
        self._prefill_body: bytes | None = None
        self._decode_body: bytes | None = None
        self._prompt_text: str | None = None
        self.migration: migrate.CallMigration | None = None
        """Whether and how the decode stream may move to another endpoint (``migration._core``)."""
        self.decision: Decision | None = None
        """Whether the call gets a remote prefill, and why (``remote_prefill``)."""
        self.warm_up_url: str | None = None
        """The prefill endpoint this decode-only call's prompt was queued to (``fleet._warm``)."""
        self.usage_merge: usage.UsageMerge | None = None
        """The caller's usage made of both legs' (``wire._usage``): set with the decode's response."""
        self.usage_strip: usage.UsageStrip | None = None
        """Takes out of the caller's stream the usage event pdclient asked for (``_asks_usage``)."""
        self.collector: AnswerCollector | None = None
        """The answer the caller receives, kept to remember the turn (chat, ``remote_prefill`` not ``always``)."""
        self._conversation: dict[str, Any] | None = None
        self.dispatch: str | None = None
        """How the legs went out, ``sequential`` or ``concurrent`` (``_dispatch``), once a prefill is planned."""
        self.prefill_picked = False
        """The prefill's first endpoint is picked already (a concurrent decode named it)."""
        self.home: RouteDecision | None = None
        """The conversation's decode endpoint by rendezvous, the same in every process (``_conversation_home``)."""
        self.stored_state: str | None = None
        """The field naming server-stored state the call builds on (``Dialect.stored_state``): decode-only."""
        # openai's `timeout` bounds each read; the prefill phase (retries included) gets it,
        # or the shorter prefill_timeout, as a total.
        bounds = [(request.extensions.get("timeout") or {}).get("read"), context.options.retries.prefill_timeout]
        given = [b for b in bounds if b is not None]
        self.deadline = time.monotonic() + min(given) if given else None
        self.observers.call_start(self)

    # -- planning ----------------------------------------------------------------------

    def plan_or_refuse(self) -> httpx.Response | None:
        """Read the caller's body (already read); a 400 response if it cannot take a P/D handoff."""
        assert self.dialect is not None
        try:
            wire.check_content_encoding(self.request.headers.get("content-encoding"))
            self.plan = self.dialect.plan(self.request.content, self.tenant)
        except wire.Refusal as exc:
            return self.refuse(str(exc))
        options = self.context.options
        policy = self.plan.options.on_prefill_failure
        if policy not in (None, *PREFILL_FAILURE_POLICIES) and not options.allow_call_fallback_url:
            return self.refuse(
                f"{CALL_OPTIONS_KEY}.on_prefill_failure may be {' or '.join(PREFILL_FAILURE_POLICIES)} here, "
                "not a fallback URL (allow_call_fallback_url is off)"
            )
        overriding = call_override_refusal(self.plan.options, options)
        return self.refuse(overriding) if overriding is not None else None

    @property
    def streams_upload(self) -> bool:
        """A pass-through multipart upload not read yet: it goes on unread, scanned as it passes
        (``wire.UploadScan``). Any other body is read and checked before it is sent."""
        if wire.media_type(self.request.headers.get("content-type")) != wire.MULTIPART:
            return False
        try:
            self.request.content  # noqa: B018 (whether it was read: a server passing bodies on reads them)
        except httpx.RequestNotRead:
            return True
        return False

    def check_pass_through(self) -> httpx.Response | None:
        """A pass-through body, read: a 400 if it could carry a ``kv_transfer_params`` pdclient
        did not write, or misspelt per-call options; else None, the JSON body's options removed."""
        headers = self.request.headers
        try:
            wire.check_forwarded_body(
                self.request.content, headers.get("content-type"), headers.get("content-encoding")
            )
            if wire.media_type(headers.get("content-type")) == "application/json":
                self.pass_through_body = wire.without_call_options(self.request.content)
        except wire.Refusal as exc:
            return self.refuse(str(exc))
        return None

    def check_upload(self) -> httpx.Response | None:
        """A multipart upload that streams unread: a 400 if it is compressed (nothing could check it)."""
        try:
            wire.check_content_encoding(self.request.headers.get("content-encoding"))
        except wire.Refusal as exc:
            return self.refuse(str(exc))
        return None

    def refuse(self, message: str) -> httpx.Response:
        self.outcome = Outcome.REFUSED
        self.error = message
        return self._end_early(self._json_error(400, message, "client"))

    @property
    def failure_policy(self) -> str:
        assert self.plan is not None
        return self.plan.options.on_prefill_failure or self.context.options.on_prefill_failure

    def route_for(self, leg: str) -> RouteRequest:
        return self._route(leg)

    def _route(self, leg: str) -> RouteRequest:
        plan = self.plan
        if plan is None:
            return RouteRequest(leg=leg, tenant=self.tenant)
        text = None
        pool = self.context.fleet.prefill if leg == "prefill" else self.context.fleet.decode
        if getattr(pool.policy, "wants_prompt_text", False):
            if self._prompt_text is None:  # once per call, and only for a policy that reads it
                self._prompt_text = plan_text(plan) or ""
            text = self._prompt_text or None
        return RouteRequest(leg=leg, affinity_key=plan.affinity_key, prompt_text=text, tenant=self.tenant)

    # -- prefill -----------------------------------------------------------------------

    def wants_prefill(self) -> bool:
        """Whether this call gets a prefill leg (``remote_prefill``), decided once after planning.

        ``always``: yes. ``never``: no, the caller's body goes to a routed decode endpoint.
        ``auto``: a chat call is estimated against the conversation its affinity key names
        (``ConversationMemory``, one per fleet) and goes decode-only, to the decode endpoint
        that answered the previous turn, when ``decide_remote_prefill`` says its prefix is cached there;
        a completions call (nothing remembered) gets its prefill.
        """
        assert self.plan is not None and self.dialect is not None
        plan, options = self.plan, self.context.options
        self.stored_state = self.dialect.stored_state(plan)
        if self.stored_state is not None:
            self.outcome = Outcome.DECODE_ONLY  # the state is where it was stored, never on a prefill server
            self.stored_tag = self.dialect.stored_at(plan)
            return False
        mode = plan.options.remote_prefill or options.remote_prefill
        chat = plan.messages is not None  # a conversation, in chat messages (``Dialect.plan``)
        estimate = None
        home = self._conversation_home() if mode != "always" and chat else None
        if mode == "auto" and chat:
            fleet = self.context.fleet
            admitted = [e.url for e in fleet.decode.endpoints if e.admits()]
            # The rendezvous endpoint holds the conversation only when no load moved it there.
            held = home.endpoint.url if home is not None and home.rule == "key" else None
            estimate = fleet.memory.estimate(plan.affinity_key, self.conversation_body(), admitted, held)
        self.decision = decide_remote_prefill(mode, estimate, options.conversations)
        self.home = home
        if self.decision.decode_endpoint is None and home is not None:
            # Every replica sends this conversation's turns to the same decode endpoint.
            self.decision = dataclasses.replace(self.decision, decode_endpoint=home.endpoint.url)
        if mode != "always" and chat:
            self.collector = AnswerCollector(stream=plan.stream)
        if self.decision.remote_prefill:
            return True
        self.outcome = Outcome.DECODE_ONLY
        if mode == "auto" and options.conversations.warm_prefill:
            self._warm_prefill()
        return False

    def _conversation_home(self) -> RouteDecision | None:
        """The decode endpoint this conversation's turns go to in every process (rendezvous on
        its affinity key, with a load bound: ``routing.Rendezvous``); None if none is admitted."""
        assert self.plan is not None
        pool, options = self.context.fleet.decode, self.context.options
        chosen = options.decode_routing is not None or options.routing != DEFAULT_ROUTING
        policy = conversation_routing(pool.policy, chosen=chosen)
        if policy is None:
            return None  # the decode leg's own policy places it, and this process's memory finds it
        try:
            return policy_decision(policy, pool.candidates(), self._route("decode"))
        except AllEndpointsOpen:
            return None

    def _warm_prefill(self) -> None:
        """Queue this decode-only call's prompt for the prefill endpoint its conversation's
        P/D turns are routed to, so that a later one prefills only what is new (``fleet._warm``)."""
        assert self.plan is not None
        try:
            endpoint = self.context.fleet.prefill.decide(self._route("prefill")).endpoint
        except AllEndpointsOpen:
            return  # no prefill endpoint admitted: nothing to keep warm
        assert self.dialect is not None
        request = self._leg_request(endpoint.url, self.dialect.warm_up_body(self.plan), None)
        request.headers["x-request-id"] = f"{self.request_id}-warm-up"
        headers = tuple((k, v) for k, v in request.headers.multi_items() if k != "host")
        post = Fetch(str(request.url), WARM_UP_TIMEOUT, endpoint.host_name, request.content, headers)
        self.context.fleet.warm(post)
        self.warm_up_url = endpoint.url

    def conversation_body(self) -> dict[str, Any]:
        """The fields ``ConversationMemory`` reads of this chat call: its messages and its shape."""
        assert self.plan is not None
        if self._conversation is None:
            body: dict[str, Any] = {}
            for name in SHAPE_FIELDS:
                raw = self.plan.fields.get(name)
                if raw is not None:
                    try:
                        body[name] = orjson.loads(memoryview(raw))
                    except orjson.JSONDecodeError:
                        body[name] = bytes(raw).decode("utf-8", "replace")
            body["messages"] = self.plan.messages
            self._conversation = body
        return self._conversation

    def to_caller(self, data: bytes) -> bytes:
        """Bytes of the decode body on their way to the caller (the streams call this): the
        usage merged on a disaggregated call, the answer collected. Returns what goes on now
        (the merge holds a partial SSE event until its end, a JSON body until it is whole)."""
        if self.usage_merge is not None:
            data = self.usage_merge.feed(data)
        if self.id_tags is not None:
            data = self.id_tags.feed(data)
        if data and self.collector is not None:
            self.collector.feed(data)
        if self.usage_strip is not None:
            data = self.usage_strip.feed(data)
        return data

    def decode_streamed(self, reads: int) -> None:
        """The decode's event stream is whole after ``reads`` network reads (the streams call
        this): its endpoint learns the time per read, about one step of its batch."""
        self.decode.answered(reads)

    def caller_rest(self) -> bytes:
        """What the usage merge still holds, once the decode body is whole (the streams call this)."""
        rest = self.usage_merge.end() if self.usage_merge is not None else b""
        if self.id_tags is not None:
            rest = self.id_tags.feed(rest) + self.id_tags.end()
        if rest and self.collector is not None:
            self.collector.feed(rest)
        if self.usage_strip is not None:
            rest = self.usage_strip.feed(rest) + self.usage_strip.end()
        return rest

    def _remember(self) -> None:
        """A whole answer of a call that went as planned: the next turn's prefix on its decode endpoint."""
        collector, plan, decision = self.collector, self.plan, self.decision
        if collector is None or plan is None or decision is None:
            return
        if self.outcome not in (Outcome.DISAGGREGATED, Outcome.DECODE_ONLY) or self.error is not None:
            return
        endpoint = self.decode.endpoint
        if self.decode.status != 200 or endpoint is None:
            return
        answer = collector.answer()
        if answer is None:
            return
        result = self.prefill_result
        prompt_tokens = result.count if result is not None and result.ids is not None else collector.prompt_tokens
        floor = decision.estimate.cached_tokens if decision.estimate is not None else 0
        if self.outcome is Outcome.DECODE_ONLY and collector.prompt_tokens is not None:
            # The decode server's own count of this prompt: the chars-per-token ratio learns
            # from it as from a prefill's, and what it found cached is the floor that counts.
            self.context.fleet.memory.learn(self.conversation_body(), collector.prompt_tokens)
            if collector.cached_tokens is not None:
                floor = collector.cached_tokens
        self.context.fleet.memory.remember(
            plan.affinity_key,
            self.conversation_body(),
            answer,
            endpoint.url,
            prompt_tokens=prompt_tokens,
            cached_floor=floor,
            prompt_pulled=self.outcome is Outcome.DISAGGREGATED,
        )

    def prefill_retrying(self) -> dict[str, object]:
        self.phase = Phase.PREFILL
        return retry.prefill_policy(self.context.options.retries, self.deadline or float("inf"))

    def prefill_request(self) -> httpx.Request:
        """The next prefill attempt, on an endpoint this call has not tried yet if any."""
        assert self.plan is not None and self.dialect is not None
        if self.prefill_picked:
            self.prefill_picked = False
            base = self.prefill.url
        else:
            base = self.prefill.pick(self._route("prefill"))
        if self._prefill_body is None:
            self._prefill_body = self.dialect.prefill_body(self.plan)
        request = self._leg_request(base, self._prefill_body, self._sign(base, self._prefill_body), self.deadline)
        request.headers["accept"] = "application/json"
        return self.prefill.start(request)

    def check_prefill(self, response: httpx.Response) -> httpx.Response | None:
        """Judge one prefill attempt, body read: raise to retry, return a response to end the call, or None."""
        assert self.dialect is not None
        if response.status_code < 300:
            self.prefill.answered()  # one token
        self.prefill.end(response.status_code, None)
        if retry.is_transient_status(response.status_code):
            raise retry.RetryableStatus(response)
        self.prefill_ms = self._elapsed_ms()
        if response.status_code >= 400:
            # The request itself is wrong (bad model, messages, ...): the decode leg would
            # refuse it too, so the caller gets the prefill's own error.
            self.outcome = Outcome.FAILED
            self.error = f"prefill answered HTTP {response.status_code}"
            return self._end_with(response, "prefill")
        cpu_start = time.thread_time()
        self.prefill_result = self.dialect.read_prefill(response.content)
        _dispatch.learn(self)
        self.cpu_seconds += time.thread_time() - cpu_start
        if self.collector is not None and self.prefill_result.ids is not None:
            # The chars-per-token ratio auto's estimates use, from the servers' own count.
            self.context.fleet.memory.learn(self.conversation_body(), self.prefill_result.count)
        return None

    def prefill_failed(self, error: BaseException) -> httpx.Response | None:
        """The prefill leg failed for good: apply the failure policy."""
        self.prefill_ms = self._elapsed_ms()
        if isinstance(error, retry.RetryableStatus):
            reason = f"HTTP {error.response.status_code}: {_text(error.response)[:200]}"
        else:
            reason = f"{type(error).__name__}: {error}"
        attempts = self.prefill.attempt
        reason = f"{reason} (after {attempts} attempt{'s' * (attempts != 1)})"
        self.prefill_result = None
        policy = self.failure_policy
        if policy == "fail":
            self.outcome = Outcome.FAILED
            self.error = f"prefill failed: {reason}"
            if isinstance(error, retry.RetryableStatus):
                return self._end_with(error.response, "prefill")
            status = 503 if isinstance(error, AllEndpointsOpen) else 502
            return self._end_early(self._json_error(status, f"prefill leg failed: {reason}", "prefill"))
        self.outcome = Outcome.PREFILL_FAILED
        if policy == "decode":
            self.fallback = f"prefill failed, decode-only: {reason}"
        else:
            self.fallback_url = policy
            self.fallback = f"prefill failed, sent to {policy}: {reason}"
        return None

    # -- decode ------------------------------------------------------------------------

    def decode_request(self) -> httpx.Request:
        """The next decode attempt; raises ``AllEndpointsOpen`` when no endpoint is admitted."""
        self.phase = Phase.DECODE
        if self.migration is not None and self.migration.pending is not None:
            return self.decode.start(self.migration.continuation_request(self))  # a migrated decode
        decision, home = self.decision, self.home
        held = decision.decode_endpoint if decision is not None and not decision.remote_prefill else None
        if self.fallback_url is not None:
            base = self.decode.use(self.fallback_url)
        else:
            # A decode-only call by decision goes to the endpoint holding its conversation; a
            # handoff's decode goes to the conversation's rendezvous endpoint when it admits,
            # so the next turn finds it from any process.
            pinned = None
            if held is not None and not self.decode.attempt:
                pinned = self.decode.pin(held, "held")
            elif home is not None and not self.decode.attempt:
                pinned = self.decode.pin(home.endpoint.url, home.rule or "key", home.policy)
            elif self.stored_tag is not None and not self.decode.attempt:
                # Only the endpoint that stored the response has it; an endpoint no longer in
                # the pool leaves the call routed as any other, and that server answers.
                stored_at = endpoint_for(self.stored_tag, (e.url for e in self.context.fleet.decode.endpoints))
                pinned = self.decode.pin(stored_at, STORED_STATE) if stored_at is not None else None
            if held is not None and pinned is None:
                self._hand_off_instead()
                raise HandoffInstead
            base = pinned or self.decode.pick(self._route("decode"))
        if self.plan is None:
            return self.decode.start(self._leg_request(base, self.pass_through_body, None))
        cpu_start = time.thread_time()
        first = self._decode_body is None
        if self._decode_body is None:
            self._decode_body = self.armed_decode_body(self.prefill_result)
            if self._asks_usage():
                self._decode_body = usage.with_usage_asked(self._decode_body)
        signed_with = self._sign(base, self._decode_body)  # a fresh nonce per attempt
        if first:
            self.cpu_seconds += time.thread_time() - cpu_start
        return self.decode.start(self._leg_request(base, self._decode_body, signed_with))

    def _asks_usage(self) -> bool:
        """Whether this decode-only chat stream asks its server for the usage the caller did not:
        the prompt's length and cache hits, the truth the conversation estimates learn from."""
        plan = self.plan
        return (
            self.collector is not None
            and plan is not None
            and plan.kind is wire.Kind.CHAT  # the other APIs' streams report usage on their own
            and plan.stream
            and self.outcome is Outcome.DECODE_ONLY
            and "stream_options" not in plan.fields
        )

    def _hand_off_instead(self) -> None:
        """A call sent decode-only to the endpoint holding its conversation cannot go there (it
        stopped admitting, or its attempt failed): on any other decode endpoint nothing of the
        conversation is cached, so the call becomes a P/D handoff, as ``auto`` decides for a
        conversation whose endpoint is unavailable."""
        decision = self.decision
        assert decision is not None
        estimate = decision.estimate
        if estimate is not None:
            total = estimate.total_tokens
            estimate = Estimate(total, total, None, Match.ENDPOINT_UNAVAILABLE)
        self.decision = decide_remote_prefill("auto", estimate, self.context.options.conversations)
        if not self.decision.remote_prefill:  # a prompt estimated at no tokens at all
            self.decision = Decision(True, Reason.UNCACHED_RATIO_AT_OR_ABOVE, None, estimate)
        self.outcome = Outcome.DISAGGREGATED
        self.migration = None
        self._decode_body = None

    def decode_admitted(self) -> bool:
        """Whether a decode endpoint admits a request now (asked before the prefill)."""
        return any(endpoint.admits() for endpoint in self.context.fleet.decode.endpoints)

    def decode_outage(self) -> httpx.Response | None:
        """No decode endpoint admits a request: a prefill now would only hold KV blocks that
        no decode pulls. The call fails at once with the 503 of a decode outage, or, when
        its failure policy names a fallback server, goes there whole (then None)."""
        try:
            self.context.fleet.decode.candidates()
            return None  # one was admitted again meanwhile: the call goes on as usual
        except AllEndpointsOpen as exc:
            outage = exc
        policy = self.failure_policy
        if policy in PREFILL_FAILURE_POLICIES:
            return self.decode_unavailable(outage)
        self.outcome = Outcome.PREFILL_FAILED
        self.fallback_url = policy
        self.fallback = f"no decode endpoint admitted, sent to {redact_url(policy)}: {outage}"
        return None

    def decode_attempt_failed(self, error: BaseException) -> None:
        """Opening the decode leg raised; a request that may have reached its server is never released.

        A transport error after the connection was made (a read timeout, a reset) says it
        may have; a cancel says nothing, so ``decode_event`` watches the bytes going out.
        """
        if isinstance(error, httpx.TransportError) and not isinstance(error, _NOT_SENT):
            self.decode_may_have_reached = True
        self.decode.end(None, error)

    def decode_event(self, event: str) -> None:
        """httpcore's ``trace`` extension on the decode leg: once its request starts going out,
        the server may run it (and, on vLLM 0.27+, frees the prefill's KV itself if it is aborted)."""
        if event in _SENDING:
            self.decode_may_have_reached = True

    def _usage_merge_for(self, response: httpx.Response) -> usage.UsageMerge | None:
        """How the decode body's ``usage`` is merged on its way to the caller, if it is.

        A disaggregated call's prompt side (``prompt_tokens``, ``prompt_tokens_details``:
        the cached tokens) is the prefill's, as vllm-router reports it; the completion side
        is the decode's. A decode-only or fallback call's usage is the decode's, unchanged.
        """
        result = self.prefill_result
        if self.outcome is not Outcome.DISAGGREGATED or result is None or self.dialect is None:
            return None
        if response.status_code != 200:
            return None
        return self.dialect.usage_merge(result, response.headers.get("content-type", ""))

    def decode_response(
        self, response: httpx.Response, stream: httpx.SyncByteStream | httpx.AsyncByteStream
    ) -> httpx.Response:
        """The caller's response: the decode's status, headers (plus the trace's) and body stream."""
        self.decode_may_have_reached = True
        self.phase = Phase.STREAMING
        self.decode.status = response.status_code
        self.decode_headers_ms = (time.perf_counter() - self.decode.sent_at) * 1000
        if response.status_code >= 400 and self.kind is not None:
            self.outcome = Outcome.FAILED
            self.error = f"decode answered HTTP {response.status_code}"
            self.failed_leg = "decode"
        # Before the caller reads a byte; a continuation after a migration keeps it (same prompt side).
        self.usage_merge = self._usage_merge_for(response)
        asked = self._decode_body is not None and self._asks_usage() and response.status_code == 200
        self.usage_strip = usage.UsageStrip() if asked else None
        self.id_tags = self._id_tags_for(response)
        # The merged usage and the tagged ids change a JSON body's length.
        recounted = any(m is not None and not m.stream for m in (self.usage_merge, self.id_tags))
        headers = _without_trace_headers(response.headers, _CONTENT_LENGTH if recounted else ())
        if self.kind is not None:
            headers += _raw_headers(self.trace().to_headers())
        return httpx.Response(response.status_code, headers=headers, stream=stream, extensions=response.extensions)

    def _id_tags_for(self, response: httpx.Response) -> IdTags | None:
        """How a Responses answer from a pool's decode endpoint gets that endpoint's tag in its ids."""
        endpoint = self.decode.endpoint
        answers = self.dialect.tags_answer_ids if self.dialect is not None else names_a_response(self.relative_path)
        if not answers or endpoint is None or response.status_code != 200:
            return None
        content_type = response.headers.get("content-type", "")
        if content_type.startswith("text/event-stream"):
            return IdTags(endpoint_tag(endpoint.url), stream=True)
        if content_type.startswith("application/json"):
            return IdTags(endpoint_tag(endpoint.url), stream=False)
        return None

    def decode_unavailable(self, error: AllEndpointsOpen) -> httpx.Response:
        self.outcome = Outcome.FAILED
        self.error = str(error)
        return self._end_early(self._json_error(503, str(error), "decode"))

    def first_byte(self) -> None:
        self.decode_first_byte_ms = (time.perf_counter() - self.decode.sent_at) * 1000
        self.observers.first_byte(self)

    def broken_stream(
        self, error: httpx.TransportError | httpx.DecodingError, received: int, not_moved: str | None = None
    ) -> openai.APIConnectionError:
        """A decode stream cut mid-way, as the openai error a caller already handles.

        openai 3.x maps an httpx error during iteration to APIConnectionError itself, 2.x
        lets the raw httpx error through; raising the openai error here makes both alike.
        ``not_moved``: why it did not move to another decode endpoint (default: the call's).
        """
        self.outcome = Outcome.FAILED
        self.error = f"decode stream broke after {received} bytes: {type(error).__name__}: {error}"
        not_moved = not_moved or (self.migration.refused if self.migration is not None else None)
        if not_moved:
            self.error += f"; not migrated: {not_moved}"
        self.decode.end(self.decode.status, error)
        message = f"pdclient: {self.error} (decode {redact_url(self.decode.url)}, request {self.request_id})"
        return openai.APIConnectionError(message=message, request=self.request)  # type: ignore[arg-type]

    def decode_closed(self) -> None:
        """The caller's response body was closed: read to its end, abandoned, or broken."""
        self.decode.end(self.decode.status, None)
        self.end()

    # -- the KV release ----------------------------------------------------------------

    def release_request(self) -> tuple[Leg, httpx.Request] | None:
        """A one-token decode that frees the prefill's KV blocks, when the handoff was abandoned
        before any decode request could have reached a server (never a second pull)."""
        result = self.prefill_result
        if (
            self.plan is None
            or result is None
            or not result.holds_remote_kv
            or self.fallback_url is not None
            or self.decode_may_have_reached
        ):
            return None
        pool = self.context.fleet.decode
        leg = Leg(self, "release", pool)
        try:
            base = leg.pick(self._route("decode"))
        except AllEndpointsOpen:
            # Every breaker is open, yet the prefill server holds the blocks until a decode
            # pulls them or the connector's lease ends (minutes): one try is worth it (a
            # refused connection costs nothing), on an endpoint the decode leg did not try.
            untried = [e for e in pool.endpoints if e not in self.decode.tried]
            if not untried:
                return None  # each failed this very call: the blocks expire with the lease
            endpoint = min(untried, key=lambda e: e.in_flight)
            base = leg.take(RouteDecision("release", endpoint, rule="breaker_open"))
        assert self.dialect is not None
        content = self.dialect.release_body(self.plan, result)
        request = self._leg_request(base, content, self._sign(base, content))
        request.extensions = {
            **request.extensions,
            "timeout": dict.fromkeys(("connect", "read", "write", "pool"), RELEASE_TIMEOUT),
        }
        return leg, leg.start(request)

    # -- ending ------------------------------------------------------------------------

    def abandoned(self, error: BaseException) -> None:
        """The call ends with an exception before its response was handed back."""
        if self.phase is Phase.ENDED:
            return
        self.outcome = Outcome.FAILED if self.kind else self.outcome
        self.error = self.error or f"{type(error).__name__}: {error}".rstrip(": ")
        self.prefill.end(None, error)
        self.decode.end(None, error)
        self.end()

    def end(self) -> None:
        """Deliver the trace; exactly once per call."""
        if self.phase is Phase.ENDED:
            return
        self.phase = Phase.ENDED
        self._remember()
        trace = self.trace()
        if self.kind is not None:
            if trace.outcome in (Outcome.FAILED, Outcome.REFUSED):
                # The caller gets this as an error already; a warning would say it twice.
                logger.info(
                    "P/D call %s %s: %s", self.request_id, trace.outcome.value, trace.error, extra={CALL_RECORD: True}
                )
            elif trace.outcome not in (Outcome.DISAGGREGATED, Outcome.DECODE_ONLY) or trace.fallback:
                # An answer that came back degraded (after a prefill failure, on a fallback server,
                # after a migration):
                # nothing else tells the caller, so it is never silent.
                logger.warning(
                    "P/D call %s %s: %s",
                    self.request_id,
                    trace.outcome.value,
                    trace.fallback or trace.error,
                    extra={CALL_RECORD: True},
                )
            elif logger.isEnabledFor(logging.DEBUG):
                logger.debug("P/D call %s: %s", self.request_id, trace)
        self.observers.call_end(self, trace)

    def _end_early(self, response: httpx.Response) -> httpx.Response:
        self.end()
        return response

    def _end_with(self, response: httpx.Response, leg: str) -> httpx.Response:
        """A leg's error response, body read, handed to the caller as the call's answer."""
        self.failed_leg = leg
        # The body was read (so decoded): its length and encoding are set anew.
        headers = _without_trace_headers(response.headers, _READ_BODY_FRAMING)
        headers += _raw_headers(self.trace().to_headers())
        return self._end_early(httpx.Response(response.status_code, headers=headers, content=response.content))

    # -- results -----------------------------------------------------------------------

    @property
    def forwarded_tokens(self) -> int:
        result = self.prefill_result
        if result is None or result.ids is None or self.plan is None or self.plan.ids_skipped is not None:
            return 0
        if self.dispatch == _dispatch.CONCURRENT:
            return 0  # the decode rendered the prompt itself: its ids were not known yet
        return result.count

    def trace(self) -> PDTrace:
        plan, result = self.plan, self.prefill_result
        ids_skipped = None
        if self.outcome is Outcome.DISAGGREGATED and plan is not None and result is not None:
            ids_skipped = plan.ids_skipped or result.problem
        fallback = self.fallback
        if fallback is None and ids_skipped is not None:
            fallback = f"ids not forwarded: {ids_skipped}"
        moved = self.migration.summary() if self.migration is not None else None
        decision = self.decision
        estimate = decision.estimate if decision is not None else None
        if moved:
            fallback = f"{fallback}; {moved}" if fallback else moved
        return PDTrace(
            request_id=self.request_id,
            route=self.route,
            outcome=self.outcome,
            prefill_url=self.prefill.url or None,
            decode_url=self.decode.url or None,
            prefill_ms=self.prefill_ms,
            prefill_attempts=self.prefill.attempt,
            decode_headers_ms=self.decode_headers_ms,
            decode_first_byte_ms=self.decode_first_byte_ms,
            forwarded_tokens=self.forwarded_tokens,
            ids_skipped=ids_skipped,
            handoff_cpu_ms=self.cpu_seconds * 1000 if self.kind else None,
            fallback=fallback,
            error=self.error,
            failed_leg=self.failed_leg,
            prefill_route=str(self.prefill.decision) if self.prefill.decision else None,
            decode_route=str(self.decode.decision) if self.decode.decision else None,
            migrations=self.migration.records() if self.migration is not None else (),
            remote_prefill=False if self.stored_state else decision.remote_prefill if decision else None,
            remote_prefill_reason=STORED_STATE if self.stored_state else decision.reason.value if decision else None,
            conversation=estimate.match.value if estimate is not None else None,
            estimated_prompt_tokens=estimate.total_tokens if estimate is not None else None,
            estimated_uncached_tokens=estimate.uncached_tokens if estimate is not None else None,
            prefill_warm_up_url=self.warm_up_url,
            dispatch=self.dispatch,
        )

    def _json_error(self, status: int, message: str, leg: str) -> httpx.Response:
        """A response the openai SDK turns into its usual APIStatusError, naming the cause
        (the leg that failed is in the x-pd-failed-leg header)."""
        self.failed_leg = leg
        body = {"error": {"message": f"pdclient: {message}", "type": "pdclient_error", "code": status}}
        headers = {**self.trace().to_headers(), "content-type": "application/json"}
        return httpx.Response(status, headers=headers, content=orjson.dumps(body))

    def _elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000

    def leg_request(self, base: str, content: bytes) -> httpx.Request:
        """A leg's request on ``base`` with a body pdclient built, signed if a secret is set."""
        return self._leg_request(base, content, self._sign(base, content))

    def armed_decode_body(self, prefill: wire.PrefillResult | None) -> bytes:
        """The decode body for ``prefill``'s KV, with the call's migration armed where its
        dialect allows one (a stream that may move carries what its continuation needs)."""
        assert self.plan is not None and self.dialect is not None
        refusal = self.dialect.migration_refusal
        self.migration = migrate.arm(self) if refusal is None else migrate.CallMigration(self.plan, 0, refusal, None, 0)
        if self.migration.armed:
            return self.migration.decode_body(self.plan, prefill)
        return self.dialect.decode_body(self.plan, prefill)

    def reset_decode_body(self) -> None:
        """The decode body is built anew at the next attempt (a concurrent decode fell back)."""
        self._decode_body = None

    def _sign(self, base: str, content: bytes) -> str | None:
        """The leg's signature for servers whose server patch guards kv_transfer_params, if a secret is set."""
        secret = self.context.options.reuse_secret
        if not secret:
            return None
        return signature(secret, self.request.method, httpx.URL(base + self.relative_path).path, content)

    def _leg_request(
        self, base: str, content: bytes | None, signed_with: str | None, deadline: float | None = None
    ) -> httpx.Request:
        """A leg's request: the caller's method, path, query and headers, on ``base``.

        ``content`` None forwards the caller's body stream as it is (pass-through: a
        multipart upload is never read into memory here).
        """
        url = self.request.url
        if self.relative_path:
            url = leg_url(base, self.relative_path, url.query)
        # One pass over the caller's raw headers: httpx's Headers.pop scans them per name.
        raw = self.request.headers.raw
        headers = [(k, v) for k, v in raw if k.lower() not in _DROPPED_REQUEST_HEADERS]
        # The caller's own id goes on as the bytes it came as (decoded with the headers' encoding).
        headers += [(b"x-request-id", self.request_id.encode(self.request.headers.encoding)), (b"host", url.netloc)]
        if signed_with is not None:
            headers.append((SIGNATURE_HEADER.encode("ascii"), signed_with.encode("ascii")))
        extensions = _timeout_within(self.request.extensions, deadline)
        if content is None:
            headers += [(k, v) for k, v in raw if k.lower() in _BODY_FRAMING]
            stream = _ScannedUpload(self.request.stream) if self.streams_upload else self.request.stream
            return httpx.Request(self.request.method, url, headers=headers, stream=stream, extensions=extensions)
        return request_with_content(self.request.method, url, headers, content, extensions)


class _ScannedUpload(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A multipart upload on its way to the server, unread: each chunk is scanned
    (``wire.UploadScan``) before it is sent, so a refused one never reaches the server
    whole (its form is never parsed) and the transport answers the ``Refusal`` with a 400.
    Iterated again (a retry), it scans the caller's stream again from its start."""

    def __init__(self, stream: httpx.SyncByteStream | httpx.AsyncByteStream) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        scan = wire.UploadScan()
        for chunk in self._stream:  # type: ignore[union-attr]
            scan.feed(chunk)
            yield chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        scan = wire.UploadScan()
        async for chunk in self._stream:  # type: ignore[union-attr]
            scan.feed(chunk)
            yield chunk

    def close(self) -> None:
        if isinstance(self._stream, httpx.SyncByteStream):
            self._stream.close()

    async def aclose(self) -> None:
        if isinstance(self._stream, httpx.AsyncByteStream):
            await self._stream.aclose()


def _timeout_within(extensions: dict[str, Any], deadline: float | None) -> dict[str, Any]:
    """A copy of request extensions whose timeouts end no later than ``deadline`` (None: unchanged)."""
    if deadline is None:
        return dict(extensions)
    remaining = max(0.001, deadline - time.monotonic())
    timeouts = extensions.get("timeout") or {}
    clipped = {k: remaining if v is None else min(v, remaining) for k, v in timeouts.items()}
    return {**extensions, "timeout": clipped}


def _without_trace_headers(headers: httpx.Headers, dropped: Collection[bytes] = ()) -> list[tuple[bytes, bytes]]:
    """A server's response headers without any ``x-pd-*`` of its own (only pdclient writes
    those) nor those ``dropped`` (lower-case names), to which the trace's are added."""
    # As raw bytes: a value beyond ASCII passes as it came (as str, httpx would encode it as
    # ASCII), and one pass over the list (httpx's Headers.update and pop scan it per name).
    return [
        (k, v)
        for k, v in headers.raw
        if not (name := k.lower()).startswith(RAW_TRACE_HEADER_PREFIX) and name not in dropped
    ]


def _raw_headers(trace_headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """``PDTrace.to_headers()`` (ASCII by construction) as raw header pairs."""
    return [(k.encode("ascii"), v.encode("ascii")) for k, v in trace_headers.items()]


def _text(response: httpx.Response) -> str:
    try:
        return response.text
    except (UnicodeDecodeError, LookupError):
        return repr(response.content[:200])
