"""Exact cache knowledge from vLLM's KV events: the events' wire shape (``_events``), the
chain keys that name a token sequence's blocks (``_chain``), one endpoint's index of the
blocks it holds (``_index``), and the subscriptions that feed them (``_subscriber``,
``_feeds``; pyzmq, the ``pdclient[kv-events]`` extra)."""

from ._chain import ROOT, block_key, chain_keys, pack, turn_keys, unpack
from ._events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, decode_batch
from ._feeds import KVEventFeeds
from ._index import DEFAULT_MAX_BLOCKS, Feed, KVIndex, View
from ._setting import DISCOVER, DISCOVERY_PATH, check_setting, source_for, source_from_discovery
from ._subscriber import KVEventSource, Subscriber, import_zmq

__all__ = [
    "DEFAULT_MAX_BLOCKS",
    "DISCOVER",
    "DISCOVERY_PATH",
    "ROOT",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "Feed",
    "KVEventFeeds",
    "KVEventSource",
    "KVIndex",
    "Subscriber",
    "View",
    "block_key",
    "check_setting",
    "chain_keys",
    "decode_batch",
    "import_zmq",
    "pack",
    "source_for",
    "source_from_discovery",
    "turn_keys",
    "unpack",
]
