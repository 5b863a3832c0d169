"""The process's KV event subscriptions: one per endpoint, whatever asks for them."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence

from ._index import DEFAULT_MAX_BLOCKS, KVIndex
from ._subscriber import KVEventSource, Subscriber


class KVEventFeeds:
    """Each watched endpoint's ``KVIndex``, fed by its own subscriber thread."""

    def __init__(self, *, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        self.max_blocks = max_blocks
        self._subscribers: dict[str, Subscriber] = {}
        self._lock = threading.Lock()

    def watch(self, sources: Iterable[KVEventSource]) -> None:
        """Subscribe to each source whose endpoint is not watched yet (or moved address)."""
        for source in sources:
            with self._lock:
                current = self._subscribers.get(source.endpoint)
                if current is not None and current.source == source:
                    continue
                subscriber = Subscriber(source, KVIndex(max_blocks=self.max_blocks))
                self._subscribers[source.endpoint] = subscriber
            if current is not None:
                current.close()
            subscriber.start()

    def index(self, endpoint: str) -> KVIndex | None:
        """The endpoint's index; None when it is not watched."""
        subscriber = self._subscribers.get(endpoint)
        return subscriber.index if subscriber is not None else None

    def held_tokens(self, endpoint: str, keys: Sequence[int], block_size: int) -> int | None:
        """How many leading tokens of the chain ``keys`` the endpoint holds; None when its
        events do not say (not watched, or its view not current)."""
        index = self.index(endpoint)
        return index.cached_tokens(keys, block_size) if index is not None else None

    def sources(self) -> list[KVEventSource]:
        with self._lock:
            return [subscriber.source for subscriber in self._subscribers.values()]

    def close(self) -> None:
        with self._lock:
            subscribers, self._subscribers = list(self._subscribers.values()), {}
        for subscriber in subscribers:
            subscriber.close()
