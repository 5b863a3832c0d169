"""Prefill warm-ups: the prompt of a decode-only call, sent to the prefill server off the caller's path.

``remote_prefill="auto"`` sends a follow-up decode-only when the decode server holds most
of it. The prefill server then never sees that turn: the next turn that does go through
P/D (a long tool output, a pasted document) would have it prefill every skipped turn
again, and be slower than with ``"always"`` (measured: 1.5-1.7 times the TTFT on the real
pair, docs/conversations.md). So each decode-only call by decision also queues its
prompt, as a plain one-token call (no ``kv_transfer_params``: nothing is held for a
decode), for the prefill endpoint the conversation's P/D turns are routed to; its prefix
cache keeps up as it does under ``"always"``, and the caller waits for none of it.

The cost is the prefill server's compute for those prompts, the same as ``"always"``
spends; ``ConversationSettings.warm_prefill=False`` turns it off (then ``"auto"`` saves
that compute and pays for it on the next P/D turn).

A warm-up is nobody's answer, so it yields to the callers' work on its prefill server: one
at a time per server, none while a caller's prefill from this process is in flight there
(the end of the last one wakes the driver: ``Endpoint.when_idle``), and none while the
server's last fresh scrape counted requests waiting there (looked at again every
``WARM_UP_LOAD_POLL``). Posted at once instead, the warm-ups of fast decode-only turns
piled up on the prefill server, and every P/D call (a conversation's first turn) queued
behind them: on vLLM's multi-turn benchmark a first turn's prefill took 2.3 s (median;
4.0 s p90) under ``auto`` against 1.8 s (2.4 s) under ``always``, which was ``auto``'s
whole TTFT p99.

``PrefillWarmer`` is a sans-I/O core of ``fleet._background``: the fleet's background driver
(a thread, or a task for an async client) posts what is due, each warm-up a job of its own
within ``WARM_UP_TIMEOUT``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import orjson

from ..pools import Endpoint
from ..wire import prefill_usage
from ._background import Fetch, Fetched, Job, JobResult

logger = logging.getLogger("pdclient")

WARM_UP_TIMEOUT = 60.0
"""Seconds a warm-up may take: a prefill of a few hundred tokens, on a busy server."""
WARM_UP_MAX_SLEEP = 60.0
"""Seconds the warm-ups' driver sleeps at most. Whatever makes a warm-up due wakes it (one
queued, the end of a caller's prefill it waited for, the end of a warm-up) or says when
(``WARM_UP_LOAD_POLL``), so this only bounds a wake-up that went missing. Woken every
second instead, as the fleet's scrapes are, it was half of an idle proxy's CPU: ~0.2 ms a
wake-up on the CPU pair's AMD EPYC, ~1 ms a call at the pace of vLLM's multi-turn benchmark."""
WARM_UP_QUEUE = 64
"""Warm-ups waiting at most; a newer one of the same conversation covers an older one's prefix."""
WARM_UP_LOAD_POLL = 0.25
"""Seconds between looks at a prefill server whose last scrape counted requests waiting: a
new count comes only with the next scrape (every 0.5 s by default). A warm-up held for
this process's own callers is not looked at on a timer: polled every 50 ms, it cost the
proxy's event loop ~8 ms of CPU a second while it waited."""


@dataclass(frozen=True)
class _WarmUp:
    post: Fetch
    target: str
    """The prefill server it warms: one warm-up at a time each."""
    endpoint: Endpoint | None

    def busy(self) -> bool:
        """Whether this process's callers have prefills in flight on the endpoint."""
        return self.endpoint is not None and self.endpoint.in_flight > 0

    def queued(self, now: float) -> bool:
        """Whether others' requests wait there, as the server's last fresh scrape said
        (load-aware routing scrapes it)."""
        load = self.endpoint.load if self.endpoint is not None else None
        return load is not None and load.fresh(now) and load.waiting > 0


class PrefillWarmer:
    """The queue of warm-ups to post; the oldest is dropped when ``capacity`` are waiting.

    Its counters say what became of them, and what the prefill servers computed for them
    (their ``usage``: ``cached_tokens`` needs vLLM's ``--enable-prompt-tokens-details``).
    """

    def __init__(self, capacity: int = WARM_UP_QUEUE, wake: Callable[[], object] | None = None) -> None:
        self._queue: deque[_WarmUp] = deque(maxlen=capacity)
        self._posting: set[str] = set()
        """The targets with a warm-up in flight."""
        self._held_at: float | None = None
        """When ``due`` last held a warm-up back for others' waiting requests (None: it did not)."""
        self.wake = wake
        """Asks the driver for ``due`` now (``Background.wake``): the end of a caller's prefill
        that held a warm-up back calls it."""
        self._lock = threading.Lock()
        self.added = 0
        self.posted = 0
        self.failed = 0
        self.dropped = 0
        self.prompt_tokens = 0
        self.cached_tokens = 0

    def __repr__(self) -> str:
        return f"PrefillWarmer(pending={self.pending}, posted={self.posted}, failed={self.failed})"

    @property
    def pending(self) -> int:
        """Warm-ups queued or in flight."""
        return self.added - self.posted - self.failed - self.dropped

    def add(self, post: Fetch, endpoint: Endpoint | None = None) -> None:
        """Queue ``post`` for the prefill ``endpoint``, held back while a caller's prefill is
        in flight there (None: an endpoint of its own, ``post``'s URL, never held)."""
        with self._lock:
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append(_WarmUp(post, endpoint.url if endpoint is not None else post.url, endpoint))
            self.added += 1

    def due(self, now: float) -> list[Job]:
        """The oldest waiting warm-up of each server with none in flight and no caller's prefill."""
        jobs: list[Job] = []
        with self._lock:
            self._held_at = None
            kept: list[_WarmUp] = []
            for warm_up in self._queue:
                if warm_up.target in self._posting:
                    kept.append(warm_up)
                elif warm_up.busy():
                    kept.append(warm_up)
                    if warm_up.endpoint is not None and self.wake is not None:
                        warm_up.endpoint.when_idle(self.wake)
                elif warm_up.queued(now):
                    kept.append(warm_up)
                    self._held_at = now
                else:
                    self._posting.add(warm_up.target)
                    jobs.append(Job(warm_up.target, warm_up.post))
            self._queue.clear()
            self._queue.extend(kept)
        return jobs

    def next_due(self) -> float:
        with self._lock:
            if self._held_at is not None:
                return self._held_at + WARM_UP_LOAD_POLL
            # A warm-up held back for a caller's prefill is due when that ends (``wake``).
            return 0.0 if any(w.target not in self._posting and not w.busy() for w in self._queue) else float("inf")

    def apply(self, job: Job, outcome: JobResult, now: float) -> None:
        with self._lock:
            self._posting.discard(str(job.key))
        if isinstance(outcome, Fetched) and outcome.ok:
            prompt, cached = _usage(outcome.text)
            with self._lock:
                self.prompt_tokens += prompt
                self.cached_tokens += cached
                self.posted += 1
            return
        with self._lock:
            self.failed += 1
        what = (
            outcome.error
            if isinstance(outcome, Fetched) and outcome.error
            else f"HTTP {getattr(outcome, 'status', None)}"
        )
        logger.debug("pdclient: prefill warm-up to %s failed: %s", job.key, what)


def _usage(text: str) -> tuple[int, int]:
    """A prefill answer's prompt tokens and cached prompt tokens (0 for what it does not say)."""
    try:
        usage = prefill_usage(orjson.loads(text))
    except orjson.JSONDecodeError:
        return 0, 0
    if usage is None:
        return 0, 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return usage["prompt_tokens"], cached if type(cached) is int else 0
