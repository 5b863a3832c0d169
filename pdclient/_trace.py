"""``PDTrace``: what one call did, for programs (fields) and for people (``fallback`` text).

A call's trace reaches the caller's observers at its end (``on_trace`` is one), and its
fields known when the decode response starts travel as ``x-pd-*`` response headers, so
``with_raw_response`` users can read them with ``PDTrace.from_headers``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from .wire import TRACE_HEADER_PREFIX as HEADER_PREFIX
from .wire import redact_url


class Outcome(str, enum.Enum):
    """How a call ended, machine-readable. ``PDTrace.fallback`` says why in words."""

    DISAGGREGATED = "disaggregated"
    """Prefill on a prefill server, decode on a decode server (``ids_skipped`` says if no ids went along)."""
    DECODE_ONLY = "decode_only"
    """No prefill leg, by decision (``remote_prefill``): ``"never"``, or ``"auto"`` found the
    conversation's prefix cached on the decode endpoint that answered its previous turn.
    Not a degradation: ``fallback`` stays None; ``remote_prefill_reason`` says why."""
    PREFILL_FAILED = "prefill_failed"
    """The prefill leg failed for good and the failure policy sent the call on without it
    (to a decode server, or to the fallback URL); ``fallback`` names the cause."""
    REFUSED = "refused"
    """The request could not take a P/D handoff (a 400 naming why); no server was called."""
    FAILED = "failed"
    """The call ended in an error: a leg's error status, no admitted endpoint, a broken stream, an exception."""
    PASSTHROUGH = "passthrough"
    """Not a chat or completions call: sent to a decode endpoint as it was."""


class Migration(BaseModel):
    """One move of a call's decode stream to another decode endpoint after it broke."""

    model_config = ConfigDict(frozen=True)

    from_url: str
    """The decode endpoint whose stream broke."""
    to_url: str
    """The decode endpoint the continuation streamed from."""
    after_tokens: int
    """Generated token ids carried into the continuation's prompt: the answer's tokens the caller had."""
    pause_ms: float | None = None
    """From the caller's last chunk before the cut to its first chunk after it (None: none came)."""
    route: str = "decode"
    """``decode`` (the decode endpoint computed the continuation's prompt itself) or
    ``prefill+decode`` (a prefill endpoint computed it and its KV was handed over)."""
    cause: str = ""
    """What broke the stream, in words."""

    @field_validator("from_url", "to_url", "cause")
    @classmethod
    def _without_credentials(cls, value: str) -> str:
        return redact_url(value)  # as PDTrace's: a record is shown


class CostDecision(BaseModel):
    """Why ``auto`` sent a call its way, and what each way was predicted to cost
    (``pdclient.costs``): the remote prefill's decision and the handoff's dispatch."""

    model_config = ConfigDict(frozen=True)

    route: str
    """``decode_only`` or ``handoff``."""
    reason: str
    """As ``PDTrace.remote_prefill_reason``."""
    decode_only_ms: float | None = None
    """The predicted time to first token decode-only (None: not predicted, ``always``/``never``)."""
    handoff_ms: float | None = None
    """The predicted time to first token through a P/D handoff."""
    stall_ms: float | None = None
    """What decode-only would make the decode server's running streams wait."""
    streams: int | None = None
    """The streams counted running on the decode endpoint when it decided."""
    charged_ms: float | None = None
    """What the decode-only turns admitted while they ran already made the most stalled of
    this process's streams there wait; ``stall_ms`` added to it is held to the budget."""
    stall_budget_ms: float | None = None
    """The most decode-only could make them wait: a share of their answer's time, or a fixed ms."""
    dispatch: str | None = None
    """A handoff's dispatch, ``sequential`` or ``concurrent`` (None: no prefill leg)."""
    dispatch_reason: str | None = None
    """Why ``dispatch="auto"`` chose it: ``learning``, ``concurrent_faster``,
    ``sequential_faster``, ``probe``, ``coordinates_unstable`` (``costs.DispatchReason``);
    None when the mode was not ``auto``, or no coordinates allowed concurrency."""
    sequential_ms: float | None = None
    concurrent_ms: float | None = None
    """``dispatch="auto"``: the predicted time to first token of each mode on the prefill endpoint."""


_NOT_IN_HEADERS = {"decode_first_byte_ms", "migrations", "leg_request_id", "decision"}


class PDTrace(BaseModel):
    """What one chat or completions call did. Times are milliseconds measured on the client."""

    model_config = ConfigDict(frozen=True)

    request_id: str
    """The caller's correlation id: its ``x-request-id``, else a random one made for the call."""
    route: str
    """The API of a P/D call (``chat``, ``completions``, ``responses``, ``messages``: its
    dialect, ``pdclient.dialects``) or ``passthrough``."""
    outcome: Outcome = Outcome.DISAGGREGATED
    prefill_url: str | None = None
    decode_url: str | None = None
    prefill_ms: float | None = None
    """From the call's start to the prefill leg's answer (retries included)."""
    prefill_attempts: int = 0
    decode_headers_ms: float | None = None
    """From sending the decode request to its response status and headers."""
    decode_first_byte_ms: float | None = None
    """From sending the decode request to the first byte of its body."""
    forwarded_tokens: int = 0
    """How many prompt token ids went to the decode leg (0 when none did)."""
    ids_skipped: str | None = None
    """Why no ids went to the decode leg of a disaggregated call: ``media``, ``echo``,
    ``forward_ids off``, or what was wrong with the prefill's answer."""
    handoff_cpu_ms: float | None = None
    """Client CPU time spent reading the prefill result and building (and signing) the decode body."""
    fallback: str | None = None
    """How the call degraded, in words (the prefill failed and the policy took over, or no
    ids went along); None when it went as planned."""
    error: str | None = None
    """Why the call was refused or failed, in words (``outcome`` refused or failed)."""
    failed_leg: str | None = None
    """``client`` (refused), ``prefill`` or ``decode``: whose answer the caller got as an error."""
    prefill_route: str | None = None
    """How the prefill endpoint was chosen (its last attempt's ``RouteDecision``):
    ``policy[/rule][ name=value ...]``, e.g. ``cache_aware/cache match=1536 prompt=2048``."""
    decode_route: str | None = None
    """How the decode endpoint was chosen, e.g. ``load_aware/load score=2`` or ``least_outstanding``."""
    remote_prefill: bool | None = None
    """Whether the call was planned with a remote prefill (``PDOptions.remote_prefill``);
    None for calls that are never split (refused before planning, pass-through)."""
    remote_prefill_reason: str | None = None
    """Why, machine-readable: ``mode_always``, ``mode_never``, ``no_estimate`` (not a chat
    call), ``uncached_at_or_above_threshold`` (an operator's fixed cap), ``uncached_ratio_at_or_above``,
    ``adds_media`` (the turn adds an image, audio, a file: only the server's encoder knows
    its tokens), ``stall_over_budget``, ``handoff_faster``, ``decode_only_faster``
    (``conversations.Reason``; ``decision`` has the predicted costs); ``stored_state`` (a Responses call on a
    ``previous_response_id`` or ``conversation``: decode-only, where that state is)."""
    conversation: str | None = None
    """How an ``auto`` chat call related to the conversation remembered under its key:
    ``extends_answer``, ``extends_prompt``, ``unknown``, ``edited``, ``reshaped``,
    ``endpoint_unavailable``, ``extends_history``, ``unseen_history`` (``conversations._memory.Match``)."""
    estimated_prompt_tokens: int | None = None
    """``auto``: the prompt's estimated length in tokens."""
    estimated_uncached_tokens: int | None = None
    """``auto``: of those, the tokens estimated not in the decode endpoint's prefix cache."""
    cache_source: str | None = None
    """``auto``: what said how much of the prompt the decode endpoint holds: ``"kv_events"``
    (its own KV events about the conversation's known ids, ``PDOptions.kv_events``) or
    ``"estimate"`` (pdclient's memory and estimate alone)."""
    cached_tokens: int | None = None
    """``auto``: the prompt's tokens the decision counted as cached on the decode endpoint."""
    tokenize_ms: float | None = None
    """``auto``: how long the prefill server's ``/tokenize`` of the prompt took, asked for a
    history no one here saw answered when the decode endpoint's KV events can say how much
    of it the decode holds (then ``cache_source`` is ``"kv_events"``); None when not asked."""
    prefill_warm_up_url: str | None = None
    """``auto``, decode-only: the prefill endpoint the prompt was queued to, off the caller's
    path, to keep its prefix cache up with the conversation (``fleet._warm``)."""
    dispatch: str | None = None
    """How the handoff's legs went out: ``"sequential"`` (the prefill, then the decode) or
    ``"concurrent"`` (both at once, ``PDOptions.dispatch``); None when no prefill leg ran.
    A concurrent call that fell back to a sequential decode (a changed prefill endpoint, a
    failed decode, a decode that rendered another prompt than the prefill) says so in ``fallback``."""
    dispatch_fallback: str | None = None
    """Why a concurrent call's decode went out again, sequentially, machine-readable:
    ``prefill_moved`` (the prefill ran on another server than the decode registered with: a
    restart, a retry elsewhere), ``decode_failed``, ``prompt_drift`` (the decode rendered
    another prompt than the prefill's ids: the servers' models or chat templates differ),
    ``prompt_unchecked`` (its first event gave no prompt ids to compare)."""
    migrations: tuple[Migration, ...] = ()
    """Each time the decode stream broke and the answer continued on another decode endpoint
    (``max_decode_migrations``), in order. Not in the response headers: known only later."""
    decision: CostDecision | None = None
    """Why the call went decode-only or through a handoff, sequential or concurrent, with
    each route's predicted cost: one place to read both ``auto`` decisions. Not in the response headers."""
    leg_request_id: str | None = None
    """The ``x-request-id`` both legs carried (the servers' logs name the call by it; a moved
    stream's continuation adds ``-m<n>``): random per call, never the caller's. Not in the
    response headers: vLLM's push mode pairs the legs by it, so it is the operator's to see."""

    # A base URL may carry credentials (http://user:password@host): a trace is shown (headers,
    # logs, observers), so they never reach it, neither as a URL nor inside a message.
    @field_validator("prefill_url", "decode_url", "prefill_warm_up_url", "fallback", "error")
    @classmethod
    def _without_credentials(cls, value: str | None) -> str | None:
        return None if value is None else redact_url(value)

    def to_headers(self) -> dict[str, str]:
        """The fields known when the decode response starts, as ``x-pd-*`` headers (ASCII)."""
        headers: dict[str, str] = {}
        # Read field by field, not through model_dump: every call builds these for its
        # response, and pydantic's dump was the larger part of a proxy call's trace work.
        for name, header in _HEADER_NAMES:
            value = getattr(self, name)
            if value is not None:
                headers[header] = header_value(value.value if isinstance(value, enum.Enum) else value)
        return headers

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> PDTrace:
        """Rebuild a trace from a raw response's headers (``with_raw_response``).

        A header that does not hold a valid value for its field is left out.
        """
        fields: dict[str, Any] = {"request_id": "", "route": ""}
        for name in cls.model_fields:
            value = headers.get(HEADER_PREFIX + name.replace("_", "-"))
            if value is not None:
                fields[name] = value
        while True:
            try:
                return cls.model_validate(fields)
            except ValidationError as exc:
                for error in exc.errors():
                    fields.pop(str(error["loc"][0]), None)


_HEADER_NAMES = tuple(
    (name, HEADER_PREFIX + name.replace("_", "-")) for name in PDTrace.model_fields if name not in _NOT_IN_HEADERS
)
"""Each header field and its header, in the fields' order."""


def header_value(value: object) -> str:
    """A header value any HTTP stack accepts: ASCII, one line; other characters escaped."""
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = str(value)
    if text.isascii() and text.isprintable() and "  " not in text and text.strip(" ") == text:
        return text  # already one line of single-spaced ASCII: most values (ids, URLs, numbers)
    text = " ".join(text.split())  # no CR/LF: a header value cannot start a new header
    return text.encode("ascii", "backslashreplace").decode("ascii")
