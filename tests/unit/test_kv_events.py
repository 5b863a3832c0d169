"""The KV event index against batches encoded as vLLM 0.32's own classes encode them."""

from __future__ import annotations

import gc
import hashlib
import sys
import tracemalloc
from typing import Any

import msgspec
import pytest

from pdclient import PDConfigError, PDOptions
from pdclient.fleet import Fetch, Fetched, KVEventWatch
from pdclient.kv_events import (
    KVEventFeeds,
    KVEventSource,
    KVIndex,
    View,
    chain_keys,
    check_setting,
    decode_batch,
    pack,
    source_for,
    source_from_discovery,
    turn_keys,
    unpack,
)
from pdclient.pools import BreakerSettings, EndpointPool
from pdclient.routing import LeastOutstanding


# The shapes of vllm/distributed/kv_events.py (0.32), all fields: an array-like batch of
# events tagged by class name, each a map (vLLM's KVCacheEvent is tag=True, not array_like).
class _VEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(_VEvent):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_VEvent):
    block_hashes: list[int | bytes]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(_VEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


BS = 4
_encode = msgspec.msgpack.Encoder().encode


def stored(hashes: list[Any], parent: Any, ids: list[int], **extra: Any) -> BlockStored:
    return BlockStored(hashes, parent, ids, BS, None, "GPU", None, group_idx=0, **extra)


def batch(*events: Any) -> bytes:
    return _encode(KVEventBatch(1.0, list(events), 0))


IDS = list(range(100, 120))  # five blocks of four
KEYS = chain_keys(IDS, BS)


def synced_index(*payloads: bytes) -> KVIndex:
    index = KVIndex()
    for seq, payload in enumerate(payloads):
        index.feed(seq, payload)
    return index


def test_decodes_vllm_encoding() -> None:
    payload = batch(stored([b"\x01" * 32], None, IDS[:4]), BlockRemoved([7], "GPU"), AllBlocksCleared())
    decoded = decode_batch(payload)
    assert [type(e).__name__ for e in decoded.events] == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    assert decoded.events[0].token_ids == IDS[:4]  # type: ignore[union-attr]


def test_counts_leading_blocks_across_batches_and_parents() -> None:
    index = synced_index(batch(stored([1, 2], None, IDS[:8])), batch(stored([3], 2, IDS[8:12])))
    assert index.cached_tokens(KEYS, BS) == 12
    # A chain that differs in its second block holds only the first.
    other = chain_keys([*IDS[:4], 0, 0, 0, 0, *IDS[8:]], BS)
    assert index.cached_tokens(other, BS) == 4


def test_a_turns_keys_run_through_its_answer_but_its_last_id() -> None:
    prompt, answer = IDS[:10], IDS[10:]
    assert unpack(turn_keys(prompt, answer, BS)) == chain_keys(IDS[:-1], BS)  # the last id was sampled, never computed
    assert unpack(turn_keys(prompt, [], BS)) == chain_keys(prompt, BS)


def test_keys_do_not_depend_on_vllms_hashes() -> None:
    one = synced_index(batch(stored([1, 2], None, IDS[:8])))
    other = synced_index(batch(stored([b"x" * 32, b"y" * 32], None, IDS[:8])))
    assert one.cached_tokens(KEYS, BS) == other.cached_tokens(KEYS, BS) == 8


def test_removal_and_clear() -> None:
    index = synced_index(batch(stored([1, 2, 3], None, IDS[:12])), batch(BlockRemoved([2], "GPU")))
    assert index.cached_tokens(KEYS, BS) == 4
    index.feed(2, batch(AllBlocksCleared()))
    assert index.cached_tokens(KEYS, BS) == 0


def test_gap_makes_the_view_unknown_until_a_replay_catches_up() -> None:
    first, second, third = (
        batch(stored([1], None, IDS[:4])),
        batch(stored([2], 1, IDS[4:8])),
        batch(BlockRemoved([1], "GPU")),
    )
    index = synced_index(first, second)
    assert index.cached_tokens(KEYS, BS) == 8
    assert index.feed(3, third).value == "gap"
    assert index.cached_tokens(KEYS, BS) is None
    index.begin_replay()
    for seq, payload in enumerate((first, second, batch(BlockRemoved([1], "GPU")), third)):
        index.feed_replayed(seq, payload)
    assert index.cached_tokens(KEYS, BS) is None  # not before the replay's end
    index.end_replay()
    assert index.view is View.SYNCED
    assert index.cached_tokens(KEYS, BS) == 0  # block 1 removed: the chain's first block is gone


def test_replay_that_starts_after_the_gap_leaves_it_lost_until_a_clear() -> None:
    index = synced_index(batch(stored([1], None, IDS[:4])))
    index.feed(5, batch(stored([9], None, IDS[:4])))
    index.begin_replay()
    index.feed_replayed(3, batch(stored([9], None, IDS[:4])))  # the buffer rolled past 1 and 2
    index.end_replay()
    assert index.view is View.LOST and index.cached_tokens(KEYS, BS) is None
    index.feed(4, batch(AllBlocksCleared(), stored([5], None, IDS[:4])))
    assert index.cached_tokens(KEYS, BS) == 4


def test_joining_late_needs_a_replay_and_an_empty_replay_is_an_empty_cache() -> None:
    index = KVIndex()
    assert index.cached_tokens(KEYS, BS) is None
    assert index.feed(7, batch(stored([1], None, IDS[:4]))).value == "gap"
    index.begin_replay()
    index.end_replay()
    assert index.cached_tokens(KEYS, BS) == 0


def test_a_new_stream_is_a_restart_with_an_empty_cache() -> None:
    index = synced_index(batch(stored([1, 2], None, IDS[:8])), batch(stored([3], 2, IDS[8:12])))
    index.feed(0, batch(stored([1], None, IDS[:4])))
    assert index.cached_tokens(KEYS, BS) == 4


def test_disconnect_is_unknown() -> None:
    index = synced_index(batch(stored([1], None, IDS[:4])))
    index.mark_behind("the publisher disconnected")
    assert index.cached_tokens(KEYS, BS) is None


def test_blocks_it_cannot_key_are_left_out() -> None:
    index = synced_index(
        batch(stored([1], 99, IDS[:4])),  # parent never seen stored
        batch(stored([2], None, IDS[:4], extra_keys=[("salt",)])),  # a cache salt
    )
    assert index.cached_tokens(KEYS, BS) == 0


def test_other_block_size_is_unknown_and_undecodable_is_lost() -> None:
    index = synced_index(batch(stored([1], None, IDS[:4])))
    assert index.cached_tokens(chain_keys(IDS, 8), 8) is None
    index.feed(1, b"\x93garbage")
    assert index.view is View.LOST and index.cached_tokens(KEYS, BS) is None


def sha(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "big")).digest()


def test_bounded_and_bytes_per_10k_blocks() -> None:
    index = KVIndex(max_blocks=10_000)
    ids = list(range(20_000 * BS))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.take_snapshot()
    # Churn: twice the bound stored, as 32-byte hashes (sha256, vLLM's default).
    for seq in range(200):
        first = seq * 100
        hashes = [sha(i) for i in range(first, first + 100)]
        parent = None if seq == 0 else sha(first - 1)
        index.feed(seq, batch(stored(hashes, parent, ids[first * BS : (first + 100) * BS])))
    gc.collect()
    after = tracemalloc.take_snapshot()
    tracemalloc.stop()
    used = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert len(index) == 10_000
    print(f"KVIndex: {used / 1e6:.2f} MB per 10k blocks (32-byte hashes, after churn)", file=sys.stderr)
    assert used < 2_000_000


def test_pack_round_trip() -> None:
    assert unpack(pack(KEYS)) == KEYS
    assert len(pack(KEYS)) == 8 * len(KEYS)


def test_bad_bound() -> None:
    with pytest.raises(ValueError, match="max_blocks"):
        KVIndex(max_blocks=0)


# -- the setting ----------------------------------------------------------------------

D = "http://decode-1:8200/v1"


def test_a_template_or_a_port_names_the_endpoints_host() -> None:
    assert source_for(check_setting(5557) or "", D) == KVEventSource(D, "tcp://decode-1:5557", None, "")
    both = check_setting("tcp://{host}:5557,tcp://{host}:5558") or ""
    assert source_for(both, D) == KVEventSource(D, "tcp://decode-1:5557", "tcp://decode-1:5558", "")


@pytest.mark.parametrize(
    "value", ["http://{host}:5557", "tcp://{hots}:1", 0, 70000, 1.5, "tcp://a:1,tcp://b:2,tcp://c:3"]
)
def test_a_bad_setting_is_named(value: object) -> None:
    with pytest.raises(PDConfigError, match="kv_events"):
        check_setting(value)


def test_discovery_reads_vllms_answer_on_the_endpoints_host() -> None:
    # GET /kv_event_sources, as vLLM 0.32 answered on the real pair.
    answer = (
        '{"0": {"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:30625",'
        ' "replay_endpoint": "tcp://*:30626", "buffer_steps": 10000, "hwm": 100000,'
        ' "max_queue_size": 100000, "topic": "kv"}}'
    )
    assert source_from_discovery(D, answer) == KVEventSource(D, "tcp://decode-1:30625", "tcp://decode-1:30626", "kv")
    assert source_from_discovery(D, "{}") is None
    with pytest.raises(ValueError):
        source_from_discovery(D, "[]")


# -- the fleet's watch and the option --------------------------------------------------

VLLM_SOURCES = '{"0": {"endpoint": "tcp://*:30625", "replay_endpoint": "tcp://*:30626", "topic": "kv"}}'


def test_the_watch_discovers_each_member_once_and_subscribes() -> None:
    pool = EndpointPool("decode", ("http://127.0.0.1:8200/v1",), LeastOutstanding(), BreakerSettings(), lambda: 0.0)
    feeds = KVEventFeeds()
    watch = KVEventWatch(lambda: pool.endpoints, "discover", feeds)
    try:
        (job,) = watch.due(0.0)
        assert isinstance(job.action, Fetch) and job.action.url == "http://127.0.0.1:8200/kv_event_sources"
        assert watch.due(0.0) == []  # not again while out
        watch.apply(job, Fetched(200, VLLM_SOURCES), 0.0)
        assert feeds.sources() == [
            KVEventSource("http://127.0.0.1:8200/v1", "tcp://127.0.0.1:30625", "tcp://127.0.0.1:30626", "kv")
        ]
        assert watch.due(100.0) == []  # watched: never asked again
    finally:
        feeds.close()


def test_a_member_that_publishes_nothing_is_asked_again_later() -> None:
    pool = EndpointPool("decode", ("http://127.0.0.1:8200/v1",), LeastOutstanding(), BreakerSettings(), lambda: 0.0)
    feeds = KVEventFeeds()
    watch = KVEventWatch(lambda: pool.endpoints, "discover", feeds)
    (job,) = watch.due(0.0)
    watch.apply(job, Fetched(200, "{}"), 0.0)
    assert feeds.sources() == [] and watch.due(1.0) == [] and len(watch.due(10.0)) == 1


def test_a_template_subscribes_without_asking() -> None:
    pool = EndpointPool("decode", ("http://10.0.0.7:8200/v1",), LeastOutstanding(), BreakerSettings(), lambda: 0.0)
    feeds = KVEventFeeds()
    try:
        assert KVEventWatch(lambda: pool.endpoints, "tcp://{host}:5557", feeds).due(0.0) == []
        assert [s.publisher for s in feeds.sources()] == ["tcp://10.0.0.7:5557"]
    finally:
        feeds.close()


def test_the_option_is_checked_at_construction() -> None:
    with pytest.raises(PDConfigError, match="kv_events"):
        PDOptions(prefill_base_url="http://p/v1", decode_base_url="http://d/v1", kv_events="udp://{host}:1")
    options = PDOptions(prefill_base_url="http://p/v1", decode_base_url="http://d/v1", kv_events=5557)
    assert options.kv_events == "tcp://{host}:5557"


def test_without_pyzmq_the_option_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)
    with pytest.raises(PDConfigError, match=r"pdclient\[kv-events\]"):
        PDOptions(prefill_base_url="http://p/v1", decode_base_url="http://d/v1", kv_events="discover")
