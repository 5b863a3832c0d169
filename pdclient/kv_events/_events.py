"""vLLM's KV cache events as they come over the wire: msgspec structs of the same shape.

vLLM (``vllm/distributed/kv_events.py``, 0.32) publishes an ``EventBatch`` encoded as an
array (``[ts, events, data_parallel_rank]``) whose events are maps tagged by their class
name in ``"type"``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``. The structs
here decode that encoding without importing vLLM; fields this index does not read are
left out (msgspec skips unknown map keys), so later vLLM fields decode too.
"""

from __future__ import annotations

from typing import Any

import msgspec

BlockHash = int | bytes
"""vLLM's ``ExternalBlockHash``: an int, or the hash's bytes, depending on its hash function."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Full blocks the server cached (or found cached again): their hashes, their parent
    block's hash (None: the first block of a prompt) and their tokens, ``block_size`` each."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks the server evicted from its prefix cache."""

    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The whole prefix cache was dropped (``reset_prefix_cache``)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published message's events, in the order the server's KV cache manager made them."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(EventBatch)


def decode_batch(payload: bytes) -> EventBatch:
    """An ``EventBatch`` from a message's last frame; ``msgspec.DecodeError`` (a
    ``ValueError``) on anything else, an event type this module does not know included."""
    return _DECODER.decode(payload)
