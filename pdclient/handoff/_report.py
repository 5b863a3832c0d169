"""How a call ended, for programs and for people: its ``PDTrace``, and its log record."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from .._trace import Outcome, PDTrace
from ._dispatch import CONCURRENT

if TYPE_CHECKING:
    from ._call import Call

logger = logging.getLogger("pdclient")

STORED_STATE = "stored_state"
"""``PDTrace.remote_prefill_reason`` of a call building on state a decode server stored."""

CALL_RECORD = "pdclient_call"
"""The attribute marking a log record that reports how one call ended (``Call.end``): a
program that logs each call itself (``pdclient serve``) filters these out."""


def trace_of(call: Call) -> PDTrace:
    """The call's trace as it stands."""
    plan, result = call.plan, call.prefill_result
    ids_skipped = None
    if call.record.outcome is Outcome.DISAGGREGATED and plan is not None and result is not None:
        ids_skipped = plan.ids_skipped or result.problem
    fallback = call.record.fallback
    if fallback is None and ids_skipped is not None:
        fallback = f"ids not forwarded: {ids_skipped}"
    moved = call.migration.summary() if call.migration is not None else None
    if moved:
        fallback = f"{fallback}; {moved}" if fallback else moved
    decision, stored_state = call.remote.decision, call.remote.stored_state
    estimate = decision.estimate if decision is not None else None
    return PDTrace(
        request_id=call.request_id,
        leg_request_id=call.leg_request_id,
        route=call.route,
        outcome=call.record.outcome,
        prefill_url=call.prefill.url or None,
        decode_url=call.decode.url or None,
        prefill_ms=call.record.prefill_ms,
        prefill_attempts=call.prefill.attempt,
        decode_headers_ms=call.record.decode_headers_ms,
        decode_first_byte_ms=call.record.decode_first_byte_ms,
        forwarded_tokens=forwarded_tokens(call),
        ids_skipped=ids_skipped,
        handoff_cpu_ms=call.record.cpu_seconds * 1000 if call.kind else None,
        fallback=fallback,
        error=call.record.error,
        failed_leg=call.record.failed_leg,
        prefill_route=str(call.prefill.decision) if call.prefill.decision else None,
        decode_route=str(call.decode.decision) if call.decode.decision else None,
        migrations=call.migration.records() if call.migration is not None else (),
        remote_prefill=False if stored_state else decision.remote_prefill if decision else None,
        remote_prefill_reason=STORED_STATE if stored_state else decision.reason.value if decision else None,
        conversation=estimate.match.value if estimate is not None else None,
        estimated_prompt_tokens=estimate.total_tokens if estimate is not None else None,
        estimated_uncached_tokens=estimate.uncached_tokens if estimate is not None else None,
        cache_source=estimate.cache_source if estimate is not None else None,
        cached_tokens=estimate.cached_tokens if estimate is not None else None,
        tokenize_ms=call.remote.tokenize_ms,
        prefill_warm_up_url=call.remote.warm_up_url,
        dispatch=call.record.dispatch,
        dispatch_fallback=call.record.dispatch_fallback,
        decision=call.remote.trace(call.record.dispatch, call.record.dispatch_choice) if not stored_state else None,
    )


def forwarded_tokens(call: Call) -> int:
    """How many prompt ids the decode received from the prefill, or on a decode-only call
    from a prefill server's /tokenize (0: it rendered the prompt itself)."""
    result, plan = call.prefill_result, call.plan
    if result is None and call.record.outcome is Outcome.DECODE_ONLY:
        result = call.remote.forwarded_ids  # a /tokenize's (``RemotePrefill.tokenized_prompt``)
    if result is None or result.ids is None or plan is None or plan.ids_skipped is not None:
        return 0
    if call.record.dispatch == CONCURRENT:
        return 0  # the decode rendered the prompt itself: its ids were not known yet
    return result.count


def log_end(trace: PDTrace) -> None:
    """One record per P/D call that did not go as planned; a debug one for the others, each
    naming the caller's correlation id and the legs' id (what the servers' logs show)."""
    request_id = f"{trace.request_id} (legs {trace.leg_request_id})"
    if trace.outcome in (Outcome.FAILED, Outcome.REFUSED):
        # The caller gets this as an error already; a warning would say it twice.
        logger.info("P/D call %s %s: %s", request_id, trace.outcome.value, trace.error, extra={CALL_RECORD: True})
    elif trace.outcome not in (Outcome.DISAGGREGATED, Outcome.DECODE_ONLY) or trace.fallback:
        # An answer that came back degraded (after a prefill failure, on a fallback server,
        # after a migration): nothing else tells the caller, so it is never silent.
        logger.warning(
            "P/D call %s %s: %s",
            request_id,
            trace.outcome.value,
            trace.fallback or trace.error,
            extra={CALL_RECORD: True},
        )
    elif logger.isEnabledFor(logging.DEBUG):
        logger.debug("P/D call %s: %s", request_id, trace)
