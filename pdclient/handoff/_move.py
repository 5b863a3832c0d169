"""A broken decode stream's move to another endpoint, as steps: the decisions here, the I/O in a driver.

``move`` is a flow of steps (``_steps``), as the call's own (``_flow``) is: it yields each
step that needs the network (send the continuation's prefill, open its decode, send a KV
release, read a refusal's body) and receives the step's result, or has the step's
exception thrown in. A moving decode body (``_decode_body.MovingBody``) runs it among its
own steps, with its transport's driver, which does only the I/O. It lives with ``Call`` and ``Leg``
because it takes legs; the bytes and the decisions it runs are ``migration``'s.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any

import httpx

from ..migration import CallMigration, CannotMove, Continuation, Route
from ..pools import AllEndpointsOpen
from ._call import Call
from ._release import release_leg
from ._steps import STREAM_ERRORS, OpenDecode, ReadRefusal, Release, SendPrefill, Step

_ERROR_TEXT = 300

Move = Generator[Step, Any, httpx.Response | None]


def cause(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}".rstrip(": ")


def move(
    call: Call, migration: CallMigration, error: httpx.TransportError | httpx.DecodingError, received: int
) -> Move:
    """Continue the call's broken stream (its response closed, ``received`` bytes read) on
    another decode endpoint. Returns the continuation's response, or None when the answer
    had ended (nothing to continue, nothing lost); raises the openai error saying why not."""
    tracker = migration.tracker
    assert tracker is not None
    if tracker.answered:
        return None
    reason = migration.why_not(call)
    if reason is not None:
        raise call.broken_stream(error, received, reason) from error
    try:
        continuation = migration.begin(call, cause(error))
        call.record.first_token_ms = None  # it came from another endpoint than the one the call ends on
        if continuation.route is Route.PREFILL_DECODE:
            yield from _prefill(call, migration, continuation)
        return (yield from _open(call, migration, continuation))
    except (CannotMove, AllEndpointsOpen, *STREAM_ERRORS) as failed:
        raise call.broken_stream(error, received, f"the continuation failed: {cause(failed)}") from error


def _prefill(call: Call, migration: CallMigration, continuation: Continuation) -> Generator[Step, Any, None]:
    """The continuation's prompt on a prefill endpoint; any failure sends it to the decode route."""
    try:
        request = migration.prefill_request(call, continuation)
    except AllEndpointsOpen as exc:
        continuation.route, continuation.note = Route.DECODE, f"no prefill endpoint: {exc}"
        return
    try:
        response: httpx.Response = yield SendPrefill(request)
    except Exception as exc:
        call.prefill.end(None, exc)
        continuation.route, continuation.note = Route.DECODE, f"its prefill failed: {cause(exc)}"
        return
    call.prefill.end(response.status_code, None)
    migration.read_prefill(continuation, response)


def _open(call: Call, migration: CallMigration, continuation: Continuation) -> Generator[Step, Any, httpx.Response]:
    migration.pending = continuation  # Call.decode_request builds the continuation's requests
    call.decode_may_have_reached = False
    try:
        response: httpx.Response = yield OpenDecode(call)
    except BaseException:
        # Before the exception goes on (a cancel too): free a continuation prefill's KV
        # when no decode request can have pulled it.
        if not call.decode_may_have_reached and (release := _release(call, migration, continuation)) is not None:
            yield release
        raise
    finally:
        migration.pending = None
    call.decode.status = response.status_code
    if response.status_code != 200 or not response.headers.get("content-type", "").startswith("text/event-stream"):
        body: bytes = yield ReadRefusal(response)
        text = body[:_ERROR_TEXT].decode("utf-8", "replace")
        call.decode.end(response.status_code, None)
        raise CannotMove(f"{call.decode.url} answered HTTP {response.status_code}: {text}")
    migration.moved(call, continuation)
    return response


def _release(call: Call, migration: CallMigration, continuation: Continuation) -> Release | None:
    """A one-token decode that frees a continuation prefill's KV when its decode never went out."""
    content = migration.release_body(continuation)
    pending = release_leg(call, content, continuation.request_id) if content is not None else None
    return Release(*pending) if pending is not None else None
