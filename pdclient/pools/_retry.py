"""Retry decisions for the two legs, in one place; the call's flow runs them, its drivers sleep.

- Prefill leg: cheap to repeat. Retried on connection errors, timeouts, 408, 429 and
  5xx, with exponential backoff and jitter (or the server's ``Retry-After``), on another
  endpoint when the pool has one, within ``prefill_attempts`` and the call's deadline.
- Decode leg: retried only when its request provably never reached a server (connect
  errors), never after a response status has arrived and never during a stream.

Worst case per call, counting the openai SDK's own ``max_retries`` (which repeats the
whole call after a transport error, 408, 409, 429 or 5xx)::

    (max_retries + 1) * (prefill_attempts + decode_attempts)   # defaults: 3 * (3 + 2) = 15 requests
"""

from __future__ import annotations

import email.utils
import functools
import math
import sys
import time
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

import httpx
import tenacity

from .._durations import check_seconds
from .._errors import PDConfigError

T = TypeVar("T")

RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
MAX_RETRY_AFTER = 10.0


@dataclass(frozen=True)
class RetrySettings:
    prefill_attempts: int = 3
    decode_attempts: int = 2
    backoff_initial: float = 0.05
    backoff_max: float = 2.0
    prefill_timeout: float | None = 60.0
    """Bound on the whole prefill phase, retries included (the call's own timeout also
    bounds it). openai's default timeout is 600 s: far too long to wait for a hung
    prefill before the failure policy takes over."""

    def __post_init__(self) -> None:
        for name in ("prefill_attempts", "decode_attempts"):
            value = getattr(self, name)
            if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
                raise PDConfigError(f"retries.{name} must be an int >= 1, got {value!r}")
        for name in ("backoff_initial", "backoff_max"):
            check_seconds(f"retries.{name}", getattr(self, name), zero=True)
        check_seconds("retries.prefill_timeout", self.prefill_timeout, none=True)


class RetryableStatus(Exception):
    """A leg answered with a status worth retrying elsewhere; carries the response."""

    def __init__(self, response: httpx.Response) -> None:
        super().__init__(f"HTTP {response.status_code}")
        self.response = response


# A body that cannot be decoded (a wrong content-encoding) is the server's fault: retried
# on another endpoint, then the failure policy, like a transport error.
PREFILL_RETRYABLE = (httpx.TransportError, httpx.DecodingError, RetryableStatus)


def is_transient_status(status: int) -> bool:
    return status in RETRYABLE_STATUSES or status >= 500


def counts_against_server(status: int | None) -> bool | None:
    """What a leg's outcome says of the server's health, for its circuit breaker.

    None (a transport error) and 5xx are failures; 408/429 mean busy, not broken; the
    rest are successes (a 4xx is the request's fault).
    """
    if status is None or status >= 500:
        return False
    if status in (408, 429):
        return None
    return True


def retry_after_seconds(response: httpx.Response) -> float | None:
    """The server's ``Retry-After-Ms`` / ``Retry-After`` (seconds or HTTP date), or None.

    As the openai SDK does, a value that is not a finite number of seconds >= 0 is ignored
    (the backoff applies), never slept on; a longer one is capped at ``MAX_RETRY_AFTER``.
    """
    for name, scale in (("retry-after-ms", 0.001), ("retry-after", 1.0)):
        value = response.headers.get(name)
        if value is None:
            continue
        try:
            seconds = float(value) * scale
        except ValueError:
            parsed = email.utils.parsedate_tz(value) if scale == 1.0 else None
            if parsed is None:
                continue
            seconds = max(0.0, email.utils.mktime_tz(parsed) - time.time())  # a date in the past means "now"
        if math.isfinite(seconds) and seconds >= 0:
            return min(seconds, MAX_RETRY_AFTER)
    return None


class _WaitRetryAfterOrBackoff(tenacity.wait.wait_base):
    def __init__(self, settings: RetrySettings) -> None:
        self._backoff = tenacity.wait_exponential_jitter(
            multiplier=settings.backoff_initial, max=settings.backoff_max, jitter=settings.backoff_initial
        )

    def __call__(self, retry_state: tenacity.RetryCallState) -> float:
        outcome = retry_state.outcome
        error = outcome.exception() if outcome is not None else None
        if isinstance(error, RetryableStatus):
            server_says = retry_after_seconds(error.response)
            if server_says is not None:
                return server_says
        return float(self._backoff(retry_state))


class _StopAtDeadline(tenacity.stop.stop_base):
    """Stop when the next attempt could not start before the call's deadline."""

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return time.monotonic() + (retry_state.upcoming_sleep or 0) >= self._deadline


@functools.lru_cache(maxsize=64)
def _prefill_parts(settings: RetrySettings) -> tuple[tenacity.stop.stop_base, _WaitRetryAfterOrBackoff]:
    # tenacity's stop and wait objects hold no state: built once per settings, not per call.
    return tenacity.stop_after_attempt(settings.prefill_attempts), _WaitRetryAfterOrBackoff(settings)


_PREFILL_RETRY = tenacity.retry_if_exception_type(PREFILL_RETRYABLE)


def prefill_deadline(read_timeout: float | None, settings: RetrySettings) -> float | None:
    """When a call's prefill phase (its retries included) is over, on ``time.monotonic``'s
    clock: the caller's read timeout (openai's ``timeout`` bounds each read), or the
    shorter ``prefill_timeout``, as a total; None when neither bounds it."""
    given = [bound for bound in (read_timeout, settings.prefill_timeout) if bound is not None]
    return time.monotonic() + min(given) if given else None


def prefill_policy(settings: RetrySettings, deadline: float) -> dict[str, object]:
    """tenacity arguments for the prefill leg (shared by ``Retrying`` and ``AsyncRetrying``)."""
    attempts, wait = _prefill_parts(settings)
    return {"stop": attempts | _StopAtDeadline(deadline), "wait": wait, "retry": _PREFILL_RETRY, "reraise": True}


@functools.lru_cache(maxsize=64)
def decode_policy(settings: RetrySettings) -> Mapping[str, object]:
    """tenacity arguments for opening the decode leg: only when nothing reached a server.

    One read-only mapping per settings (cached): every call unpacks the same one."""
    return MappingProxyType(
        {
            "stop": tenacity.stop_after_attempt(settings.decode_attempts),
            "wait": tenacity.wait_exponential_jitter(
                multiplier=settings.backoff_initial, max=settings.backoff_max, jitter=settings.backoff_initial
            ),
            "retry": tenacity.retry_if_exception_type((httpx.ConnectError, httpx.ConnectTimeout)),
            "reraise": True,
        }
    )


@dataclass(frozen=True, slots=True)
class Sleep:
    """A step of a flow: wait ``seconds`` before the next attempt (``time.sleep`` or ``anyio.sleep``)."""

    seconds: float


def retrying(policy: Mapping[str, object], attempt: Callable[[], Generator[Any, Any, T]]) -> Generator[Any, Any, T]:
    """``attempt()``'s steps, retried under ``policy`` (tenacity arguments): its result, or the
    last error; the waits between attempts are ``Sleep`` steps, so one loop serves both
    drivers. As ``tenacity.Retrying(**policy)(attempt)``, but the first attempt runs bare:
    tenacity's loop starts from its failure, so a call that needs no retry (all but a few)
    never pays for it (~12 us a loop, two loops a call: ~5 % of ``pdclient serve``'s own
    CPU per call). The policies here retry on errors only: a result is final.
    """
    try:
        return (yield from attempt())
    except BaseException:
        retrying, state = _after_failure(policy, sys.exc_info())
    while True:
        do = retrying.iter(state)
        if isinstance(do, tenacity.DoAttempt):
            try:
                result = yield from attempt()
            except BaseException:  # as tenacity: the policy decides, and re-raises what it won't retry
                state.set_exception(sys.exc_info())  # type: ignore[arg-type]
            else:
                state.set_result(result)
        elif isinstance(do, tenacity.DoSleep):
            state.prepare_for_next_attempt()
            yield Sleep(float(do))
        else:
            return do  # type: ignore[no-any-return]


def _after_failure(policy: Mapping[str, object], error: Any) -> tuple[tenacity.Retrying, tenacity.RetryCallState]:
    """tenacity's loop as it stands once attempt 1 has raised ``error`` (an ``exc_info``)."""
    retrying = tenacity.Retrying(**policy)  # type: ignore[arg-type]
    retrying.begin()
    state = tenacity.RetryCallState(retrying, fn=None, args=(), kwargs={})
    state.set_exception(error)
    return retrying, state
