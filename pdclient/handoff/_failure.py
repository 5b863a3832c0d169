"""How a call fails, and what its caller gets then.

The failure policy (``on_prefill_failure``: ``fail``, ``decode``, or a fallback server's
URL) decides for a call whose prefill is lost: its prefill leg failed for good, or no
decode endpoint admits a request (a prefill then would only hold KV blocks that no decode
pulls). A call that fails gets an error the openai SDK already raises as its own: a JSON
error body or a leg's own error response (``APIStatusError``), a broken stream
(``APIConnectionError``), each naming the cause and carrying the call's trace headers.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import openai
import orjson

from ..pools import AllEndpointsOpen, retry
from ..wire import error_body, redact_url
from ._to_caller import READ_BODY_FRAMING, raw_headers, without_trace_headers

_SHOWN_BODY = 200
"""How much of a failed prefill's body its reason quotes."""


class PrefillRedirected(Exception):
    """A prefill leg answered a redirect: its server ran no prefill. Not retried elsewhere
    (the same request would be redirected again), the failure policy decides; the
    answer's ``Location``, which may name a server, goes nowhere."""

    def __init__(self, status: int) -> None:
        super().__init__(f"the prefill server answered a redirect (HTTP {status}), not a prefill")


PREFILL_FAILURES = (*retry.PREFILL_RETRYABLE, AllEndpointsOpen, PrefillRedirected)
"""What ends a prefill leg for good, for the failure policy (``Call.prefill_failed``)."""


@dataclass(frozen=True, slots=True)
class Fallback:
    """Where a call whose prefill is lost goes on: its own decode pool (``url`` None, the
    caller's body decode-only) or the fallback server at ``url``; ``note`` says why."""

    url: str | None
    note: str


def fallback_for(policy: str, lost: str, reason: str, *, decode_admitted: bool) -> Fallback | None:
    """Where ``policy`` sends a call whose prefill is lost (``lost``: how, ``reason``: the
    cause); None: the call fails. ``decode`` needs an admitted decode endpoint to go to."""
    if policy == "fail" or (policy == "decode" and not decode_admitted):
        return None
    if policy == "decode":
        return Fallback(None, f"{lost}, decode-only: {reason}")
    return Fallback(policy, f"{lost}, sent to {redact_url(policy)}: {reason}")


def prefill_failure(error: BaseException, attempts: int) -> str:
    """Why a prefill leg failed for good, after ``attempts``: its last status and body, or its exception."""
    if isinstance(error, retry.RetryableStatus):
        reason = f"HTTP {error.response.status_code}: {_text(error.response)[:_SHOWN_BODY]}"
    else:
        reason = f"{type(error).__name__}: {error}"
    return f"{reason} (after {attempts} attempt{'s' * (attempts != 1)})"


def prefill_failure_status(error: BaseException) -> int:
    """The status of a call failed by its prefill leg's exception: 503 when every prefill
    endpoint's breaker is open (come back later), 502 when the endpoints answered badly."""
    return 503 if isinstance(error, AllEndpointsOpen) else 502


def error_response(status: int, message: str, trace_headers: dict[str, str]) -> httpx.Response:
    """A JSON error the openai SDK turns into its usual ``APIStatusError``, naming the cause
    (the leg that failed is in the trace's ``x-pd-failed-leg`` header)."""
    body = {"error": error_body(f"pdclient: {message}", status)}
    return httpx.Response(
        status, headers={**trace_headers, "content-type": "application/json"}, content=orjson.dumps(body)
    )


def leg_error_response(response: httpx.Response, trace_headers: dict[str, str]) -> httpx.Response:
    """A leg's own error response, its body read, as the call's answer (the request itself
    was wrong: the caller sees what the server said)."""
    headers = without_trace_headers(response.headers, READ_BODY_FRAMING) + raw_headers(trace_headers)
    return httpx.Response(response.status_code, headers=headers, content=response.content)


def stream_error(request: httpx.Request, message: str) -> openai.APIConnectionError:
    """A decode stream cut mid-way, as the openai error a caller already handles.

    openai 3.x maps an httpx error during iteration to APIConnectionError itself, 2.x lets
    the raw httpx error through; raising the openai error here makes both alike.
    """
    return openai.APIConnectionError(message=f"pdclient: {message}", request=request)  # type: ignore[arg-type]


def _text(response: httpx.Response) -> str:
    try:
        return response.text
    except (UnicodeDecodeError, LookupError):
        return repr(response.content[:_SHOWN_BODY])
