"""One endpoint's prefix cache, as its KV events tell it: which blocks it holds, by chain key.

Pure (no I/O) and thread-safe: a subscriber (``_subscriber``) feeds it each message's
sequence number and payload, callers ask ``cached_tokens``.

Blocks are keyed by ``_chain`` keys of their token ids, computed from each
``BlockStored``'s ids and its parent's key, so vLLM's hash seed never matters; a map from
vLLM's block hash to the key serves ``BlockRemoved`` and the next ``BlockStored``'s
parent. A block whose parent the index never saw stored, or that carries ``extra_keys``
(a LoRA, media, a cache salt), a LoRA name or a cache group other than the first, is not
indexed: the index then counts fewer cached tokens than the server holds, which costs a
handoff, never a stall.

The view answers only when it is known to be current (``synced``). It is not after a
sequence gap, a disconnect (the subscriber's socket monitor and ZMQ heartbeats see a
publisher that went away or went silent) or before the first message, until a replay
from the publisher's buffer (vLLM keeps its last ``buffer_steps`` batches) has caught it
up, or a new stream (a server restart: sequence 0) or an ``AllBlocksCleared`` starts it
afresh. Until then ``cached_tokens`` is None and decisions use the estimator.

Memory: two dict entries a block (vLLM's hash to the key, the key held), bounded by
``max_blocks`` (oldest stored first out: a forgotten block only counts as uncached).
tests/unit/test_kv_events.py measures 1.84 MB per 10k blocks (~184 bytes a block).
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Sequence

import msgspec

from ._chain import ROOT, chain_keys
from ._events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch, decode_batch

DEFAULT_MAX_BLOCKS = 1 << 18
"""Blocks an index keeps at most: ~48 MB at the measured ~184 bytes a block (1.84 MB per
10k blocks after churn); 4M tokens of KV in 16-token blocks, 33M in 128-token ones."""

_PRIMARY_MEDIA = (None, "GPU")
"""The tier the prefix cache serves hits from (vLLM labels it GPU on the CPU build too)."""


def _short(block_hash: BlockHash) -> int:
    """vLLM's hash as an int: its first 8 bytes when it is bytes (a 32-byte sha256 would
    take 65 bytes an entry; 64 bits tell a server's blocks apart as well)."""
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash[:8], "little")
    return block_hash


class View(str, enum.Enum):
    SYNCED = "synced"
    """Every message of the stream applied, and known current."""
    BEHIND = "behind"
    """Every message up to ``last_seq`` applied, but messages may have been missed since
    (a gap, a disconnect, no message yet): a replay catches it up."""
    LOST = "lost"
    """Messages were missed that no replay can give back: the blocks stored then are
    unknown. Events are still applied; an ``AllBlocksCleared`` or a new stream syncs it."""


class Feed(str, enum.Enum):
    APPLIED = "applied"
    DUPLICATE = "duplicate"
    GAP = "gap"
    """The message is past the next expected one: messages were missed; ask a replay."""


class KVIndex:
    """One endpoint's prefix-cache blocks, from its event stream."""

    def __init__(self, *, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if isinstance(max_blocks, bool) or not isinstance(max_blocks, int) or max_blocks < 1:
            raise ValueError(f"max_blocks must be an int >= 1, got {max_blocks!r}")
        self.max_blocks = max_blocks
        self._key_of: dict[int, int] = {}
        """vLLM's block hash (``_short``) -> chain key, oldest stored first."""
        self._held: set[int] = set()
        self.block_size: int | None = None
        self.view = View.BEHIND
        self.last_seq: int | None = None
        self.reason = "no message yet"
        """Why the view is not synced (for logs and the trace)."""
        self._replaying = False
        self._replay_started = False
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)

    @property
    def synced(self) -> bool:
        return self.view is View.SYNCED

    # -- the stream ---------------------------------------------------------------------

    def feed(self, seq: int, payload: bytes) -> Feed:
        """A live message (topic, ``seq``, ``payload``)."""
        with self._lock:
            if self._replaying:
                # The replay brings these again, in order.
                return Feed.DUPLICATE
            last = self.last_seq
            if seq == 0 and last is not None and last >= 0:
                self._clear("a new event stream (the server restarted)")
                self.view = View.SYNCED
            elif last is None:
                if seq != 0:
                    return self._behind(f"joined the stream at sequence {seq}", Feed.GAP)
                self.view = View.SYNCED
            elif seq <= last:
                return Feed.DUPLICATE
            elif seq > last + 1:
                if self.view is View.LOST:
                    self.last_seq = seq - 1
                else:
                    return self._behind(f"sequence gap: {last + 1} to {seq - 1} missed", Feed.GAP)
            self._apply(seq, payload)
            return Feed.APPLIED

    def begin_replay(self) -> None:
        """A replay from sequence 0 was asked for: live messages wait for it."""
        with self._lock:
            self._replaying, self._replay_started = True, False

    def feed_replayed(self, seq: int, payload: bytes) -> None:
        """A message of the replay, in order."""
        with self._lock:
            if not self._replaying:
                return
            if not self._replay_started:
                self._replay_started = True
                last = -1 if self.last_seq is None else self.last_seq
                if seq == 0:
                    # The stream's whole history: built again from nothing.
                    self._clear("")
                    self.last_seq = -1
                    if self.view is View.LOST:
                        self.view = View.BEHIND
                elif seq > last + 1 or self.last_seq is None:
                    self._lost(f"the replay starts at sequence {seq}, after the missed {last + 1}")
                    self.last_seq = seq - 1
            if self.last_seq is not None and seq <= self.last_seq:
                return
            self._apply(seq, payload)

    def end_replay(self) -> None:
        """The replay's end marker: the view is as current as the publisher's buffer."""
        with self._lock:
            if not self._replaying:
                return
            self._replaying = False
            if not self._replay_started:
                # Nothing in the publisher's buffer: it has published nothing since it started.
                self._clear("")
                self.last_seq = -1
            if self.view is View.BEHIND:
                self.view = View.SYNCED

    def abort_replay(self, reason: str) -> None:
        """The replay did not finish (no answer in time): still behind."""
        with self._lock:
            self._replaying = False
            if self.view is View.SYNCED:
                self.view = View.BEHIND
            self.reason = reason

    def lose_at(self, seq: int, reason: str) -> None:
        """Messages before ``seq`` were missed and no replay gives them back."""
        with self._lock:
            self._lost(reason)
            self.last_seq = seq - 1

    def mark_behind(self, reason: str) -> None:
        """Messages may be missed from now on (a disconnect, a silent publisher)."""
        with self._lock:
            self._behind(reason, Feed.GAP)

    def _behind(self, reason: str, result: Feed) -> Feed:
        if self.view is not View.LOST:
            self.view = View.BEHIND
        self.reason = reason
        return result

    def _lost(self, reason: str) -> None:
        self._clear("")
        self.view, self.reason = View.LOST, reason

    def _clear(self, reason: str) -> None:
        self._key_of.clear()
        self._held.clear()
        if reason:
            self.reason = reason

    def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        try:
            batch: EventBatch = decode_batch(payload)
        except msgspec.DecodeError as exc:
            self._lost(f"undecodable message {seq}: {exc}")
            return
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(event)
            elif isinstance(event, BlockRemoved):
                if event.medium in _PRIMARY_MEDIA and not event.group_idx:
                    for block_hash in event.block_hashes:
                        key = self._key_of.pop(_short(block_hash), None)
                        if key is not None:
                            self._held.discard(key)
            elif isinstance(event, AllBlocksCleared):
                self._clear("")
                if self.view is View.LOST and not self._replaying:
                    self.view = View.SYNCED

    def _stored(self, event: BlockStored) -> None:
        if (
            event.medium not in _PRIMARY_MEDIA
            or event.group_idx
            or event.lora_name is not None
            or event.lora_id is not None
            or (event.extra_keys is not None and any(extra is not None for extra in event.extra_keys))
        ):
            return
        size = event.block_size
        if self.block_size != size:
            # Keys of another block size name other spans: none of them would match.
            self._clear("")
            self.block_size = size
        if event.parent_block_hash is None:
            parent: int | None = ROOT
        else:
            parent = self._key_of.get(_short(event.parent_block_hash))
        if parent is None:
            return
        for block_hash, key in zip(event.block_hashes, chain_keys(event.token_ids, size, parent), strict=False):
            short = _short(block_hash)
            self._key_of.pop(short, None)
            self._key_of[short] = key
            self._held.add(key)
        while len(self._key_of) > self.max_blocks:
            oldest = next(iter(self._key_of))
            self._held.discard(self._key_of.pop(oldest))

    # -- questions ----------------------------------------------------------------------

    def cached_tokens(self, keys: Sequence[int], block_size: int) -> int | None:
        """How many leading tokens of the chain ``keys`` (``_chain.chain_keys`` in blocks
        of ``block_size``) the endpoint holds; None when the view is not current, or the
        server's blocks are of another size."""
        with self._lock:
            if self.view is not View.SYNCED:
                return None
            if not self._held:
                return 0
            if self.block_size != block_size:
                return None
            held = 0
            for key in keys:
                if key not in self._held:
                    break
                held += 1
            return held * block_size
