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

``PrefillWarmer`` is a sans-I/O core of ``fleet._background``: the fleet's background driver
(a thread, or a task for an async client) posts what is queued at once, each warm-up a
job of its own within ``WARM_UP_TIMEOUT``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque

import orjson

from ..wire import prefill_usage
from ._background import Fetch, Fetched, Job, JobResult

logger = logging.getLogger("pdclient")

WARM_UP_TIMEOUT = 60.0
"""Seconds a warm-up may take: a prefill of a few hundred tokens, on a busy server."""
WARM_UP_QUEUE = 64
"""Warm-ups waiting at most; a newer one of the same conversation covers an older one's prefix."""


class PrefillWarmer:
    """The queue of warm-ups to post; the oldest is dropped when ``capacity`` are waiting.

    Its counters say what became of them, and what the prefill servers computed for them
    (their ``usage``: ``cached_tokens`` needs vLLM's ``--enable-prompt-tokens-details``).
    """

    def __init__(self, capacity: int = WARM_UP_QUEUE) -> None:
        self._queue: deque[Fetch] = deque(maxlen=capacity)
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

    def add(self, post: Fetch) -> None:
        with self._lock:
            if len(self._queue) == self._queue.maxlen:
                self.dropped += 1
            self._queue.append(post)
            self.added += 1

    def due(self, now: float) -> list[Job]:
        with self._lock:
            jobs = [Job(post.url, post) for post in self._queue]
            self._queue.clear()
        return jobs

    def next_due(self) -> float:
        return 0.0 if self._queue else float("inf")

    def apply(self, job: Job, outcome: JobResult, now: float) -> None:
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
