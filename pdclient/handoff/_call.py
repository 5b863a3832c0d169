"""One call's state: its plan, its phase, its two legs, and how it ended.

A ``Call`` is made per request by a transport, and its flow (``_flow.call_flow``) takes it
from the caller's request to the response: the flow yields the I/O it needs to the
transport's driver and applies the decisions made here and beside it: whether it gets a
remote prefill, and what its end teaches the conversation memory and the cost model
(``_remote_prefill``, from its record: ``_record``), its legs' requests
and bodies (``_leg_requests``), what goes back to the caller (``_to_caller``), how it fails
(``_failure``), concurrent dispatch (``_dispatch``), a broken stream's move (``_move``),
the KV release (``_release``) and its trace (``_report``). Observers see the call and
its legs as ``CallView`` / ``LegView``.

    PLANNING --refused--> ENDED                     (400, no server called)
        |  |--no decode endpoint admitted--> ENDED   (503 and no prefill; or on to the fallback URL)
        |  '--decode-only (remote_prefill, stored state)--------------.
        v                                                             |
    PREFILL --fails, policy "fail"--> ENDED         (the prefill's error, or 502/503)
        |  |  (ok, or failed with policy "decode" / a fallback URL)   |
        |  '--concurrent dispatch: the decode went out with the prefill; once the
        |     prefill answered, its stream is the caller's (or it is cancelled and
        |     sent again sequentially)----------------------------.   |
        v                                                         |   v
    DECODE --no response--> ENDED                   (exception, or 503 when no endpoint is admitted)
        |  '--decode-only, its conversation's endpoint out of reach--> PREFILL (a handoff after all)
        v
    STREAMING --body closed--> ENDED                (whole, abandoned by the caller, or broken)
        |  '--finished answer cut--> ENDED          (ended as the server ended it, never moved)
        '--broke mid-answer, may move--> DECODE     (migration: [a prefill leg,] a decode leg on
                                                     another endpoint, its events in the same body)

Pass-through requests go straight to DECODE with their body as sent, once checked for a
``kv_transfer_params`` (a multipart upload is checked as it streams, never read whole).
A handoff abandoned between its prefill and any decode reaching a server sends a KV
release (``_release``) before the exception goes on.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx
import openai

from .. import migration as migrate
from .. import wire
from .. import wire as usage
from .._observe import Observers
from .._options import PDOptions
from .._trace import Outcome, PDTrace
from ..conversations import SHAPE_FIELDS
from ..dialects import endpoint_for, names_a_response
from ..fleet import Fleet
from ..pools import AllEndpointsOpen, retry
from ..routing import TENANT_EXTENSION, RouteRequest, plan_text
from ..wire import TRACE_HEADERS_EXTENSION, EventTooLarge, error_event, redact_url
from ._dispatch import learn_coordinates
from ._effective import EffectiveOptions
from ._failure import (
    Fallback,
    PrefillRedirected,
    error_response,
    fallback_for,
    leg_error_response,
    prefill_failure,
    prefill_failure_status,
    stream_error,
)
from ._leg import Leg
from ._leg_requests import (
    LegRequests,
    asks_usage,
    call_options_refusal,
    caller_target,
    decode_body,
    new_correlation_id,
    new_leg_id,
    pass_through_body,
)
from ._record import CallRecord
from ._remote_prefill import HandoffInstead, RemotePrefill
from ._report import log_end, trace_of
from ._to_caller import CallerBody, caller_response, id_tags_for, usage_merge_for

# A leg that failed so never sent a byte to its server.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)
# httpcore's trace event for the first bytes of a request going out (HTTP/1.1 and HTTP/2).
_SENDING = ("http11.send_request_headers.started", "http2.send_request_headers.started")


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


class Call:
    """One request through a P/D transport, from the caller's request to its trace."""

    def __init__(self, context: CallContext, request: httpx.Request) -> None:
        self.context = context
        self.observers = context.observers
        self.request = request
        self.request_id = request.headers.get("x-request-id") or new_correlation_id()
        """The caller's correlation id: its ``x-request-id``, else a random one (logs, traces)."""
        self.leg_request_id = new_leg_id()
        """The id both legs carry (``new_leg_id``): never the caller's, never told to it."""
        tenant = request.extensions.get(TENANT_EXTENSION)
        self.tenant: str | None = None if tenant is None else str(tenant)
        """Who is calling, as the server passing its callers' requests on named them (``TENANT_EXTENSION``)."""
        self.started = time.perf_counter()
        self.data: dict[Any, Any] = {}
        self.phase = Phase.PLANNING
        fleet = context.fleet
        self.relative_path, self.dialect, self.stored_tag = caller_target(request, fleet.decode)
        """The path below the decode base; the API a P/D call speaks (None: a pass-through)
        (``pdclient.dialects``); the decode endpoint's tag its stored response carries."""
        self.requests = LegRequests(request, self.leg_request_id, self.relative_path, context.options.reuse_secret)
        self.kind = self.dialect.kind if self.dialect is not None else None
        self.route = self.kind.value if self.kind else "passthrough"
        self.plan: wire.Plan | None = None
        self._effective: EffectiveOptions | None = None
        self.prefill = Leg(self, "prefill", fleet.prefill)
        self.decode = Leg(self, "decode", fleet.decode)
        self.prefill_result: wire.PrefillResult | None = None
        self.record = CallRecord(Outcome.DISAGGREGATED if self.kind else Outcome.PASSTHROUGH)
        """How the call went, as its report reads it (``_record``)."""
        self.fallback_url: str | None = None
        """The failure policy's fallback server, where the call's decode goes whole."""
        self.decode_may_have_reached = False
        self.pass_through_body: bytes | None = None
        """A pass-through JSON body without pdclient's per-call options; None forwards the caller's stream."""
        self._prefill_body: bytes | None = None
        self._decode_body: bytes | None = None
        self._prompt_text: str | None = None
        self.migration: migrate.CallMigration | None = None
        """Whether and how the decode stream may move to another endpoint (``migration.CallMigration``)."""
        self.remote = RemotePrefill()
        """Whether the call gets a remote prefill and why, its conversation (``_remote_prefill``)."""
        self.caller_body = CallerBody()
        """The decode body's steps on its way to the caller (the streams feed it every chunk)."""
        read_timeout = (request.extensions.get("timeout") or {}).get("read")
        self.deadline = retry.prefill_deadline(read_timeout, context.options.retries)
        self.observers.call_start(self)

    # -- planning ----------------------------------------------------------------------

    def plan_or_refuse(self) -> httpx.Response | None:
        """Read the caller's body (already read); a 400 response if it cannot take a P/D handoff."""
        assert self.dialect is not None
        try:
            wire.check_content_encoding(self.request.headers.get("content-encoding"))
            self.plan = self.dialect.plan(self.request.content, self.tenant)
            for name in SHAPE_FIELDS:  # the conversation memory reads them later: refused now if it cannot
                wire.field_value(self.plan.fields, name)
        except wire.Refusal as exc:
            return self.refuse(str(exc))
        refused = call_options_refusal(self.plan.options, self.context.options)
        if refused is not None:
            return self.refuse(refused)
        self._effective = EffectiveOptions.resolve(self.plan.options, self.context.options)
        return None

    @property
    def effective(self) -> EffectiveOptions:
        """The options this call runs under, resolved once it is planned (``_effective``)."""
        assert self._effective is not None
        return self._effective

    def check_pass_through(self, upload: bool) -> httpx.Response | None:
        """A pass-through body: a 400, or None and the body to send (``pass_through_body``);
        an ``upload`` streaming unread (``streams_upload``) is refused only compressed: nothing could check it."""
        try:
            if upload:
                wire.check_content_encoding(self.request.headers.get("content-encoding"))
            else:
                self.pass_through_body = pass_through_body(self.request)
        except wire.Refusal as exc:
            return self.refuse(str(exc))
        return None

    def refuse(self, message: str) -> httpx.Response:
        return self._fail("client", message, 400, outcome=Outcome.REFUSED)

    def route_for(self, leg: str) -> RouteRequest:
        """What the leg's routing policy may know of this call (the prompt's text once, if it reads it)."""
        plan = self.plan
        if plan is None:
            return RouteRequest(leg=leg, tenant=self.tenant)
        text = None
        pool = self.context.fleet.prefill if leg == "prefill" else self.context.fleet.decode
        if getattr(pool.policy, "wants_prompt_text", False):
            if self._prompt_text is None:  # once per call, and only for a policy that reads it
                self._prompt_text = plan_text(plan) or ""
            text = self._prompt_text or None
        held = self.remote.held_by(pool, self.context.fleet.kv_events) if text and leg == "prefill" else None
        return RouteRequest(
            leg=leg, affinity_key=plan.affinity_key, prompt_text=text, tenant=self.tenant, held_tokens=held
        )

    def prompt_ids_request(self) -> httpx.Request | None:
        """A prefill server's /tokenize of the call's prompt, when ``auto`` wants its ids (``RemotePrefill``)."""
        assert self.plan is not None and self.dialect is not None
        options, fleet, remote = self.context.options, self.context.fleet, self.remote
        remote.prepare(self.plan, self.effective.remote_prefill, self.dialect, options, fleet, self.route_for)
        return remote.tokenize_request(fleet.prefill, self.route_for, self.request, f"{self.leg_request_id}-tokenize")

    def wants_prefill(self) -> bool:
        """Whether this call gets a prefill leg (``remote_prefill``, ``_remote_prefill``), once after planning."""
        assert self.plan is not None and self.dialect is not None
        remote, options, fleet = self.remote, self.context.options, self.context.fleet
        mode = self.effective.remote_prefill
        wanted = remote.decide(self.plan, mode, self.dialect, options, fleet, self.route_for, self.requests)
        if remote.conversation is not None:
            self.caller_body.collector = remote.conversation.collector
        if not wanted:
            self.record.outcome = Outcome.DECODE_ONLY
            if remote.stored_state is not None:
                self.stored_tag = self.dialect.stored_at(self.plan)
        return wanted

    # -- prefill -----------------------------------------------------------------------

    def prefill_retrying(self) -> dict[str, object]:
        self.phase = Phase.PREFILL
        return retry.prefill_policy(self.context.options.retries, self.deadline or float("inf"))

    def prefill_request(self) -> httpx.Request:
        """The next prefill attempt, on an endpoint this call has not tried yet if any."""
        assert self.plan is not None and self.dialect is not None
        base = self.prefill.next_pick(self.route_for("prefill"))
        if self._prefill_body is None:
            self._prefill_body = self.dialect.prefill_body(self.plan)
        request = self.requests.signed(base, self._prefill_body, self.deadline)
        request.headers["accept"] = "application/json"
        return self.prefill.start(request)

    def check_prefill(self, response: httpx.Response) -> httpx.Response | None:
        """Judge one prefill attempt, body read: raise to retry (``PrefillRedirected``: to fail
        the leg at once), return a response to end the call, or None."""
        assert self.dialect is not None
        if response.status_code < 300:
            self.prefill.answered()  # one token
        elif response.status_code < 400:
            redirected = PrefillRedirected(response.status_code)
            self.prefill.end(response.status_code, redirected)
            raise redirected
        self.prefill.end(response.status_code, None)
        if retry.is_transient_status(response.status_code):
            raise retry.RetryableStatus(response)
        self.record.prefill_ms = self._elapsed_ms()
        if response.status_code >= 400:
            # The request itself is wrong (bad model, messages, ...): the decode leg would
            # refuse it too, so the caller gets the prefill's own error.
            return self._fail("prefill", f"prefill answered HTTP {response.status_code}", response)
        cpu_start = time.thread_time()
        self.prefill_result = self.dialect.read_prefill(response.content)
        if self.prefill.url:  # every prefill answer, either dispatch mode: where its server's NIXL agent is
            learn_coordinates(self.context.fleet, self.prefill.url, self.prefill_result.kv_transfer_params)
        self.record.cpu_seconds += time.thread_time() - cpu_start
        self.remote.prefilled(self.prefill_result)
        return None

    def prefill_failed(self, error: BaseException) -> httpx.Response | None:
        """The prefill leg failed for good: the failure policy fails the call, or it goes on without it."""
        self.record.prefill_ms = self._elapsed_ms()
        self.prefill_result = None
        reason = prefill_failure(error, self.prefill.attempt)
        fallback = fallback_for(self.effective.on_prefill_failure, "prefill failed", reason, decode_admitted=True)
        if fallback is not None:
            self._fall_back(fallback)
            return None
        answer = error.response if isinstance(error, retry.RetryableStatus) else prefill_failure_status(error)
        return self._fail("prefill", f"prefill failed: {reason}", answer, f"prefill leg failed: {reason}")

    # -- decode ------------------------------------------------------------------------

    def decode_request(self) -> httpx.Request | None:
        """The next decode attempt; raises ``AllEndpointsOpen`` when no endpoint is admitted.
        None: a decode-only call's conversation endpoint is out of reach, and the call becomes
        a P/D handoff after all (its prefill goes first, then the decode is opened anew)."""
        self.phase = Phase.DECODE
        if self.migration is not None and self.migration.pending is not None:
            return self.decode.start(self.migration.continuation_request(self))  # a migrated decode
        if self.fallback_url is not None:
            base = self.decode.use(self.fallback_url)
        else:
            pool = self.context.fleet.decode
            urls = (e.url for e in pool.endpoints)
            stored_at = (
                endpoint_for(self.stored_tag, urls, self.context.options.reuse_secret) if self.stored_tag else None
            )
            try:
                pinned = self.remote.pin_decode(self.decode, stored_at, self.context.options.conversations)
            except HandoffInstead:
                self.record.outcome = Outcome.DISAGGREGATED
                self.migration = self._decode_body = None
                return None
            base = pinned or self.decode.pick(self.route_for("decode"))
        if self.plan is None:
            return self.decode.start(self.requests.build(base, self.pass_through_body))
        cpu_start = time.thread_time()
        first = self._decode_body is None
        if self._decode_body is None:
            ids = self.prefill_result or self.remote.tokenized_prompt(self.plan)  # a decode-only call's
            self._decode_body = self.armed_decode_body(ids, asks_usage=self._asks_usage())
        signed_with = self.requests.sign(base, self._decode_body)  # a fresh nonce per attempt
        if first:
            self.record.cpu_seconds += time.thread_time() - cpu_start
        return self.decode.start(self.requests.build(base, self._decode_body, signed_with))

    def armed_decode_body(
        self, prefill: wire.PrefillResult | None, *, asks_usage: bool = False, checks_prompt: bool = False
    ) -> bytes:
        """The decode body for ``prefill``'s KV, the call's migration armed where its dialect allows
        one; ``checks_prompt``: tracked even if it may not move (a concurrent decode's prompt ids),
        as is a conversation's turn whose blocks the KV events are to name (``keys_answer``)."""
        assert self.plan is not None and self.dialect is not None
        refusal = self.dialect.migration_refusal
        if refusal is None:
            self.migration = migrate.arm(self, tracked=checks_prompt or self.remote.keys_answer)
        else:
            self.migration = migrate.CallMigration(self.plan, 0, refusal, None, 0)
        return decode_body(self.dialect, self.plan, prefill, self.migration, asks_usage=asks_usage)

    def decode_again(self, *, kv_spent: bool) -> None:
        """The decode goes out anew, its body built again at the next attempt (a concurrent
        decode fell back). ``kv_spent``: the prefill's KV went into the cut decode's blocks,
        so the new decode computes the prefill's ids itself (no ``kv_transfer_params``)."""
        self.migration = self._decode_body = None
        if kv_spent and self.prefill_result is not None:
            self.prefill_result = replace(self.prefill_result, kv_transfer_params=None)

    def _asks_usage(self) -> bool:
        collecting, decode_only = self.remote.conversation is not None, self.record.outcome is Outcome.DECODE_ONLY
        return self.plan is not None and asks_usage(self.plan, collecting=collecting, decode_only=decode_only)

    def decode_outage(self) -> httpx.Response | None:
        """No decode endpoint admits a request: a prefill now would only hold KV blocks that
        no decode pulls. The call fails at once with the 503 of a decode outage, or, when
        its failure policy names a fallback server, goes there whole (then None)."""
        try:
            self.context.fleet.decode.candidates()
            return None  # one was admitted again meanwhile: the call goes on as usual
        except AllEndpointsOpen as exc:
            outage = exc
        fallback = fallback_for(
            self.effective.on_prefill_failure, "no decode endpoint admitted", str(outage), decode_admitted=False
        )
        if fallback is None:
            return self.decode_unavailable(outage)
        self._fall_back(fallback)
        return None

    def _fall_back(self, fallback: Fallback) -> None:
        """The failure policy goes on without the prefill: the decode, whole, to ``fallback.url`` if any."""
        self.record.outcome, self.record.fallback = Outcome.PREFILL_FAILED, fallback.note
        self.fallback_url = fallback.url

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

    def decode_response(
        self, response: httpx.Response, stream: httpx.SyncByteStream | httpx.AsyncByteStream
    ) -> httpx.Response:
        """The caller's response: the decode's status, headers (plus the trace's) and body stream."""
        self.decode_may_have_reached = True
        self.phase = Phase.STREAMING
        status = self.decode.status = response.status_code
        self.record.decode_headers_ms = (time.perf_counter() - self.decode.sent_at) * 1000
        if status >= 400 and self.kind is not None:
            self.record.outcome = Outcome.FAILED
            self.record.error = f"decode answered HTTP {status}"
            self.record.failed_leg = "decode"
        # Before the caller reads a byte; a continuation after a migration keeps them (same prompt side).
        content_type, body = response.headers.get("content-type", ""), self.caller_body
        merge = usage_merge_for(self.dialect, self.record.outcome, self.prefill_result, status, content_type)
        asked = self._decode_body is not None and self._asks_usage() and status == 200
        tags = self.dialect.tags_answer_ids if self.dialect is not None else names_a_response(self.relative_path)
        endpoint = self.decode.endpoint.url if self.decode.endpoint is not None else None
        strip = usage.UsageStrip() if asked else None
        self.record.decoded = self.migration.tracker if self.migration is not None else None
        body.begin(
            content_type,
            merge,
            id_tags_for(tags, endpoint, status, content_type, self.context.options.reuse_secret),
            strip,
        )
        traced = self.kind is not None and (status >= 400 or self.request.extensions.get(TRACE_HEADERS_EXTENSION, True))
        return caller_response(response, stream, body, self.trace().to_headers() if traced else None)

    def decode_unavailable(self, error: AllEndpointsOpen) -> httpx.Response:
        return self._fail("decode", str(error), 503)

    def first_byte(self) -> None:
        self.decode.streaming()
        self.record.decode_first_byte_ms = (time.perf_counter() - self.decode.sent_at) * 1000
        record = self.record
        record.first_byte_ms = self._elapsed_ms()
        moved = self.migration is not None and self.migration.records()
        if self.plan is not None and self.plan.stream and self.fallback_url is None and not moved:
            record.first_token_ms = record.first_byte_ms
        self.observers.first_byte(self)

    def broken_stream(
        self, error: httpx.TransportError | httpx.DecodingError, received: int, not_moved: str | None = None
    ) -> openai.APIConnectionError:
        """A decode stream cut mid-way, as the openai error a caller already handles
        (``stream_error``); ``not_moved``: why it did not move (default: the call's reason)."""
        self.record.outcome = Outcome.FAILED
        self.record.error = f"decode stream broke after {received} bytes: {type(error).__name__}: {error}"
        not_moved = not_moved or (self.migration.refused if self.migration is not None else None)
        if not_moved:
            self.record.error += f"; not migrated: {not_moved}"
        self.decode.end(self.decode.status, error)
        return stream_error(
            self.request, f"{self.record.error} (decode {redact_url(self.decode.url)}, request {self.request_id})"
        )

    def event_too_large(self, error: EventTooLarge, received: int) -> bytes:
        """A decode stream with an event longer than pdclient handles whole: the call fails,
        and the caller's stream ends with an error event saying so (its 200 is sent; the
        openai and anthropic SDKs raise the event's message)."""
        self.record.outcome = Outcome.FAILED
        self.record.error = f"decode stream cut after {received} bytes: {error}"
        self.decode.end(self.decode.status, error)
        return error_event(f"pdclient: {error} (decode {redact_url(self.decode.url)}, request {self.request_id})")

    def decode_closed(self) -> None:
        """The caller's response body was closed: read to its end, abandoned, or broken."""
        self.decode.end(self.decode.status, None)
        self.end()

    # -- ending ------------------------------------------------------------------------

    def abandoned(self, error: BaseException) -> None:
        """The call ends with an exception before its response was handed back."""
        if self.phase is Phase.ENDED:
            return
        self.record.outcome = Outcome.FAILED if self.kind else self.record.outcome
        self.record.error = self.record.error or f"{type(error).__name__}: {error}".rstrip(": ")
        self.prefill.end(None, error)
        self.decode.end(None, error)
        self.end()

    def end(self) -> None:
        """Deliver the trace; exactly once per call."""
        if self.phase is Phase.ENDED:
            return
        self.phase = Phase.ENDED
        self.record.ended(self._elapsed_ms())
        if self.decode.endpoint is not None and self.decode.status == 200 and self.record.error is None:
            self.remote.ended(
                self.plan,
                self.record,
                self.prefill_result,
                self.context.fleet,
                decode_url=self.decode.endpoint.url,
                prefill_url=self.prefill.url or None,
            )
        trace = self.trace()
        if self.kind is not None:
            log_end(trace)
        self.observers.call_end(self, trace)

    def _fail(
        self, leg: str, error: str, answer: int | httpx.Response, message: str = "", outcome: Outcome = Outcome.FAILED
    ) -> httpx.Response:
        """End the call at ``leg`` with ``answer``: that leg's own error response (its body
        read), or a JSON error of that status saying ``message`` (default: ``error``)."""
        self.record.outcome, self.record.error, self.record.failed_leg = outcome, error, leg
        if isinstance(answer, httpx.Response):
            response = leg_error_response(answer, self.trace().to_headers())
        else:
            response = error_response(answer, message or error, self.trace().to_headers())
        self.end()
        return response

    def trace(self) -> PDTrace:
        return trace_of(self)

    def _elapsed_ms(self) -> float:
        return (time.perf_counter() - self.started) * 1000
