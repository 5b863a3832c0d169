"""Subscribing to every pool member's KV events (``PDOptions.kv_events``): a sans-I/O core
that starts one subscription per endpoint (``kv_events.KVEventFeeds``), asking the server
where it publishes first when the setting is ``"discover"``. The subscriptions are threads
of their own, so both drivers (sync and async) run the same."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from ..kv_events import DISCOVER, DISCOVERY_PATH, KVEventFeeds, source_for, source_from_discovery
from ..pools import Endpoint
from ._background import EveryMember, Fetch, Fetched, Job, JobResult
from ._load import server_url

logger = logging.getLogger("pdclient")

RETRY_S = 5.0
"""Seconds before a member whose discovery failed (or that publishes nothing) is asked again."""
TIMEOUT_S = 2.0


class KVEventWatch:
    """Sans-I/O core: a subscription for every member of a pool, once each."""

    def __init__(self, members: Callable[[], Sequence[Endpoint]], setting: str, feeds: KVEventFeeds) -> None:
        self._members = members
        self._setting = setting
        self._feeds = feeds
        self._schedule = EveryMember(self._unwatched, RETRY_S)
        self._told: set[str] = set()

    def __repr__(self) -> str:
        return f"KVEventWatch({self._setting!r})"

    def _unwatched(self) -> list[Endpoint]:
        return [e for e in self._members() if self._feeds.index(e.url) is None]

    def due(self, now: float) -> list[Job]:
        jobs: list[Job] = []
        for endpoint in self._schedule.due(now):
            if self._setting == DISCOVER:
                url = server_url(endpoint.url, DISCOVERY_PATH)
                jobs.append(Job(endpoint, Fetch(url, TIMEOUT_S, host=endpoint.host_name)))
            else:
                self._feeds.watch([source_for(self._setting, endpoint.url)])
                self._schedule.done(endpoint)
        return jobs

    def next_due(self) -> float:
        return self._schedule.next_due()

    def apply(self, job: Job, outcome: JobResult, now: float) -> None:
        endpoint = job.key
        assert isinstance(endpoint, Endpoint)
        self._schedule.done(endpoint)
        problem = None
        if isinstance(outcome, Fetched) and outcome.ok:
            try:
                source = source_from_discovery(endpoint.url, outcome.text)
            except ValueError as exc:
                problem = str(exc)
            else:
                if source is not None:
                    self._feeds.watch([source])
                    return
                problem = "it publishes no KV events (start vLLM with --kv-events-config)"
        else:
            problem = getattr(outcome, "error", None) or f"HTTP {getattr(outcome, 'status', '?')}"
        if endpoint.url not in self._told:  # once per member, not every retry
            self._told.add(endpoint.url)
            logger.warning("pdclient: no KV events of %s (%s); its decisions use the estimate", endpoint.url, problem)
