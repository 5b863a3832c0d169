"""One call as one flow of steps: every decision here, the I/O in a driver (``_steps``).

``call_flow`` takes a ``Call`` from the caller's request to the response handed back: it
plans the call, runs the prefill leg under its retries and failure policy, sends the
decode with it or after it (``_dispatch``), opens the decode leg, and releases the
prefill's KV when the handoff is abandoned between the legs. A broken decode stream's
move (``_move.move``) is a flow of the same steps, run by the same drivers.

    call_flow
      |-- pass-through: [ReadRequest] --> decode
      |-- ReadRequest, plan (400: ended)
      |-- auto, a history no one here saw: [SendPrefill] (the prompt's ids, /tokenize)
      |-- decode-only (remote_prefill) ----------------------------------> decode
      |-- concurrent: Concurrently(decode, prefill) -> Await -> first event
      |               -> Stream (its answer)  |  Cut, Discard -> decode (sequential)
      '-- prefill: [SendPrefill, Sleep]* (retries), failure policy ----> decode
    decode: [Open, Sleep]* (retries) -> Stream;  no response -> Release
            a decode-only call's conversation endpoint out of reach -> prefill, decode
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Any

import httpx

from ..pools import AllEndpointsOpen, retry
from ..wire import Refusal
from . import _dispatch as dispatch
from ._call import Call
from ._failure import PREFILL_FAILURES
from ._leg_requests import streams_upload
from ._prompt_ids import prompt_ids
from ._release import release_request
from ._steps import (
    NEXT,
    STREAM_ERRORS,
    Await,
    Chunks,
    Close,
    Concurrently,
    Cut,
    Discard,
    Open,
    ReadRequest,
    Release,
    SendPrefill,
    Step,
    Stream,
)

Steps = Generator[Step, Any, httpx.Response]


def call_flow(call: Call) -> Steps:
    """The call's steps; returns the caller's response (its body a driver's stream)."""
    try:
        if call.kind is None:
            return (yield from _pass_through(call))
        yield ReadRequest(call.request)
        ended = call.plan_or_refuse()
        if ended is None:
            yield from _prompt_ids(call)
        if ended is None and call.wants_prefill():
            sent = dispatch.concurrent_decode(call)
            if sent is not None:
                return (yield from _concurrent(call, sent))
            ended = yield from _prefill(call)
        return ended or (yield from _decode(call))
    except BaseException as exc:
        call.abandoned(exc)
        raise


def _pass_through(call: Call) -> Steps:
    upload = streams_upload(call.request)  # a multipart upload goes on unread, scanned as it passes
    if not upload:
        yield ReadRequest(call.request)
    refused = call.check_pass_through(upload)
    return refused or (yield from _decode(call))


def _prompt_ids(call: Call) -> Generator[Step, Any, None]:
    """The prompt's ids from a prefill server's /tokenize, when ``auto`` would otherwise
    decide a history no one here saw on the call's word (``_prompt_ids``); a failure of any
    kind leaves the estimate to decide."""
    request = call.prompt_ids_request()
    if request is None:
        return
    started = time.perf_counter()
    try:
        response = yield SendPrefill(request)
    except httpx.HTTPError:
        ids = None
    else:
        ids = prompt_ids(response)
    call.remote.use_prompt_ids(ids, (time.perf_counter() - started) * 1000)


def _prefill(call: Call, *, outlive: bool = False) -> Generator[Step, Any, httpx.Response | None]:
    """The prefill phase: its answer read and judged (None: the call goes on to its decode),
    or the call's end (its failure policy's answer, a decode outage's 503)."""
    if not call.context.fleet.decode.admitted():  # a prefill now would hold KV no decode pulls
        return call.decode_outage()
    try:
        return (yield from retry.retrying(call.prefill_retrying(), lambda: _prefill_attempt(call, outlive)))
    except PREFILL_FAILURES as exc:
        return call.prefill_failed(exc)


def _prefill_attempt(call: Call, outlive: bool) -> Generator[Step, Any, httpx.Response | None]:
    request = call.prefill_request()
    try:
        response = yield SendPrefill(request, outlive)
    except BaseException as exc:
        call.prefill.end(None, exc)
        raise
    return call.check_prefill(response)


def _concurrent(call: Call, sent: dispatch.ConcurrentDecode) -> Steps:
    """Both legs at once (``_dispatch``): the caller gets the concurrent decode's stream, or,
    when it cannot be the handoff's answer, it is cut and the decode goes out again after
    the prefill. Whatever ends the call meanwhile (a Ctrl-C, a cancel) cuts it too: left
    running, it would generate its answer for nobody."""
    answered = False
    try:
        ended, not_it = yield Concurrently(sent, call.decode_event, lambda: _prefill_beside(call, sent))
        if not_it is None:
            response, error = yield Await(sent)
            if error is not None:
                call.decode_attempt_failed(error)
            not_it = dispatch.failure(response, error)
            if not_it is None:
                assert response is not None
                answered = True
                try:
                    begun = yield from _first_event(response, peek := dispatch.prompt_peek(call))
                    result, migration = call.prefill_result, call.migration
                    tracked = migration is not None and migration.armed  # else no prefill ids to check
                    ids = result.ids if result is not None and tracked else None
                    not_it = dispatch.prompt_drift(call.context.fleet.coordinates, sent.coordinates, ids, peek.ids)
                except STREAM_ERRORS as exc:
                    not_it = dispatch.broke_early(exc)
                if not_it is None:
                    return (yield from _answer(call, response, begun))
    except BaseException:
        yield from _cut(call, sent)
        raise
    yield from _cut(call, sent)
    if ended is not None:
        return ended  # type: ignore[no-any-return]
    sequential_again(call, not_it or dispatch.FallBack("the decode gave no answer"), kv_spent=answered)
    return (yield from _decode(call))


def _first_event(response: httpx.Response, peek: dispatch.PromptPeek) -> Generator[Step, Any, Chunks]:
    """The decode's body read until ``peek`` has its first event; returns the read, begun,
    for the caller's body to go on with. Raises what the stream raised."""
    rest = yield Chunks(response)
    read: list[bytes] = []
    while (chunk := (yield NEXT)) is not None:
        read.append(chunk)
        if peek.feed(chunk):
            break
    return Chunks(response, read, rest)


def _cut(call: Call, sent: dispatch.ConcurrentDecode) -> Generator[Step, Any, None]:
    yield Cut(sent)
    status, error = yield Discard(sent)
    call.decode.end(*dispatch.discarded(status, error))


def _prefill_beside(
    call: Call, sent: dispatch.ConcurrentDecode
) -> Generator[Step, Any, tuple[httpx.Response | None, dispatch.FallBack | None]]:
    """The prefill phase while the decode is in flight; the decode is cut as soon as it is
    known not to be the handoff's answer. Returns the prefill's end, and why the decode is not."""
    try:
        ended = yield from _prefill(call, outlive=True)
        if ended is not None:
            not_it: dispatch.FallBack | None = dispatch.FallBack("the prefill failed")
        else:
            answered = call.context.fleet.coordinates.get(call.prefill.url)
            not_it = dispatch.moved_on(call.prefill_result, answered, sent.coordinates)
    except BaseException:
        yield Cut(sent)
        raise
    if not_it is not None:
        yield Cut(sent)
    return ended, not_it


def sequential_again(call: Call, fallback: dispatch.FallBack, *, kv_spent: bool = False) -> None:
    """The concurrent decode was cut or failed: the call's decode goes out anew, sequentially.

    ``kv_spent``: the decode had answered, so the prefill server has WRITTEN its KV into
    that decode's blocks and freed its own; the new decode computes the prefill's ids itself.
    """
    record = call.record
    record.dispatch, record.dispatch_fallback = dispatch.SEQUENTIAL, fallback.reason  # a sequential decode answers
    call.decode_again(kv_spent=kv_spent)
    note = f"concurrent dispatch fell back to sequential: {fallback.why}"
    record.fallback = f"{record.fallback}; {note}" if record.fallback else note


def _decode(call: Call) -> Steps:
    while True:
        try:
            response = yield from open_decode(call)
        except AllEndpointsOpen as exc:
            yield from _release(call)
            return call.decode_unavailable(exc)
        except Refusal as exc:  # an upload refused as it streamed: it never reached its server whole
            return call.refuse(str(exc))
        except BaseException:
            yield from _release(call)
            raise
        if response is not None:
            break
        ended = yield from _prefill(call)  # a handoff after all (``Call.decode_request``)
        if ended is not None:
            return ended
    try:
        return (yield from _answer(call, response))
    except BaseException:
        yield Close(response)
        raise


def _answer(call: Call, response: httpx.Response, begun: Chunks | None = None) -> Steps:
    body = yield Stream(call, response, begun)
    return call.decode_response(response, body)


def open_decode(call: Call) -> Generator[Step, Any, httpx.Response | None]:
    """The decode leg opened, retried only while nothing reached a server (``retry.decode_policy``);
    None: the call becomes a handoff after all (``Call.decode_request``)."""
    return (yield from retry.retrying(retry.decode_policy(call.context.options.retries), lambda: _decode_attempt(call)))


def _decode_attempt(call: Call) -> Generator[Step, Any, httpx.Response | None]:
    request = call.decode_request()
    if request is None:
        return None
    try:
        response: httpx.Response = yield Open(request, call.decode_event)
    except BaseException as exc:
        call.decode_attempt_failed(exc)
        raise
    return response


def _release(call: Call) -> Generator[Step, Any, None]:
    """The handoff was abandoned between the legs: free the prefill's KV blocks now, before
    the exception goes on (a background thread would die with the process)."""
    pending = release_request(call)
    if pending is not None:
        yield Release(*pending)


__all__ = ["call_flow", "open_decode", "sequential_again"]
