"""The KV event subscriber against a loopback publisher that behaves as vLLM 0.32's
ZmqEventPublisher does: a PUB socket sending (topic, 8-byte seq, msgpack batch), and a
ROUTER replay socket answering (client, b"", start seq) with its buffer from that seq and
an end marker (seq -1)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")

from pdclient import AsyncPDChatClient, PDChatClient  # noqa: E402
from pdclient.kv_events import KVEventSource, KVIndex, Subscriber, View, chain_keys  # noqa: E402
from tests.unit.test_kv_events import BS, IDS, KEYS, AllBlocksCleared, BlockRemoved, batch, stored  # noqa: E402

END = (-1).to_bytes(8, "big", signed=True)


class Publisher:
    def __init__(self, pub_port: int = 0, replay_port: int = 0) -> None:
        self.ctx = zmq.Context.instance()
        self.pub = self.ctx.socket(zmq.PUB)
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.replay.setsockopt(zmq.LINGER, 0)
        self.pub_port = self._bind(self.pub, pub_port)
        self.replay_port = self._bind(self.replay, replay_port)
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.skip_next = False
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve_replay, daemon=True)
        self.thread.start()

    @staticmethod
    def _bind(sock: Any, port: int) -> int:
        if port:
            sock.bind(f"tcp://127.0.0.1:{port}")
            return port
        return int(sock.bind_to_random_port("tcp://127.0.0.1"))

    def publish(self, payload: bytes, *, lose: bool = False) -> None:
        with self.lock:
            seq, self.seq = self.seq, self.seq + 1
            self.buffer.append((seq, payload))
            if not lose:
                self.pub.send_multipart((b"kv", seq.to_bytes(8, "big"), payload))

    def _serve_replay(self) -> None:
        while not self.stop.is_set():
            if not self.replay.poll(50):
                continue
            client, _, start = self.replay.recv_multipart()
            with self.lock:
                for seq, payload in self.buffer:
                    if seq >= int.from_bytes(start, "big"):
                        self.replay.send_multipart((client, b"", b"kv", seq.to_bytes(8, "big"), payload))
                self.replay.send_multipart((client, b"", b"", END, b""))

    def source(self) -> KVEventSource:
        return KVEventSource(
            "http://d/v1", f"tcp://127.0.0.1:{self.pub_port}", f"tcp://127.0.0.1:{self.replay_port}", "kv"
        )

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.pub.close(linger=0)
        self.replay.close(linger=0)


def wait_for(check: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


def test_joins_late_through_the_replay_then_follows_live(publisher: Publisher) -> None:
    publisher.publish(batch(stored([1, 2], None, IDS[:8])))  # before anyone listens
    index = KVIndex()
    sub = Subscriber(publisher.source(), index).start()
    try:
        wait_for(lambda: index.cached_tokens(KEYS, BS) == 8)
        publisher.publish(batch(stored([3], 2, IDS[8:12])))
        wait_for(lambda: index.cached_tokens(KEYS, BS) == 12)
        publisher.publish(batch(BlockRemoved([1], "GPU")))
        wait_for(lambda: index.cached_tokens(KEYS, BS) == 0)
    finally:
        sub.close()


def test_a_lost_message_is_recovered_from_the_replay(publisher: Publisher) -> None:
    index = KVIndex()
    sub = Subscriber(publisher.source(), index).start()
    try:
        wait_for(lambda: index.synced)
        publisher.publish(batch(stored([1, 2], None, IDS[:8])))
        wait_for(lambda: index.cached_tokens(KEYS, BS) == 8)
        publisher.publish(batch(BlockRemoved([2], "GPU")), lose=True)
        publisher.publish(batch(stored([7], None, [9, 9, 9, 9])))
        # The gap is seen, the replay brings the removal: the chain's second block is gone.
        wait_for(lambda: index.cached_tokens(KEYS, BS) == 4)
        assert index.view is View.SYNCED
    finally:
        sub.close()


def test_a_restarted_publisher_is_unknown_at_once_then_a_new_empty_stream() -> None:
    first = Publisher()
    ports = first.pub_port, first.replay_port
    index = KVIndex()
    sub = Subscriber(first.source(), index).start()
    try:
        wait_for(lambda: index.synced)
        first.publish(batch(stored([1, 2], None, IDS[:8])))
        wait_for(lambda: index.cached_tokens(KEYS, BS) == 8)
        first.close()
        t0 = time.monotonic()
        wait_for(lambda: index.cached_tokens(KEYS, BS) is None)
        assert time.monotonic() - t0 < 1.0
        second = Publisher(*ports)
        try:
            # Its empty replay says its cache is empty: nothing of the old view is kept.
            wait_for(lambda: index.cached_tokens(KEYS, BS) == 0)
            second.publish(batch(stored([5], None, IDS[:4])))
            wait_for(lambda: index.cached_tokens(KEYS, BS) == 4)
        finally:
            second.close()
    finally:
        sub.close()


def test_clear_event_empties_the_view(publisher: Publisher) -> None:
    index = KVIndex()
    sub = Subscriber(publisher.source(), index).start()
    try:
        wait_for(lambda: index.synced)
        publisher.publish(batch(stored([1], None, IDS[:4])))
        wait_for(lambda: index.cached_tokens(KEYS, BS) == 4)
        publisher.publish(batch(AllBlocksCleared()))
        wait_for(lambda: index.cached_tokens(KEYS, BS) == 0)
        assert index.cached_tokens(chain_keys(IDS, BS), BS) == 0
    finally:
        sub.close()


def test_events_per_second_one_subscriber_keeps_up_with(publisher: Publisher) -> None:
    index = KVIndex()
    sub = Subscriber(publisher.source(), index).start()
    try:
        wait_for(lambda: index.synced)
        ids = list(range(2000 * BS))
        t0 = time.perf_counter()
        for n in range(2000):
            publisher.publish(batch(stored([n + 1], n or None, ids[n * BS : (n + 1) * BS])))
        wait_for(lambda: index.last_seq == 1999, timeout=30)
        elapsed = time.perf_counter() - t0
        assert index.synced and len(index) == 2000
        print(f"\n2000 BlockStored batches applied in {elapsed * 1000:.0f} ms", end="")
    finally:
        sub.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
async def test_both_clients_subscribe_in_their_fleets_background(publisher: Publisher, asynchronous: bool) -> None:
    """Each pool member gets one subscription, started by the fleet's background work,
    whichever driver runs it (the endpoints need not answer: a template asks nothing)."""
    template = f"tcp://{{host}}:{publisher.pub_port},tcp://{{host}}:{publisher.replay_port}"
    urls = {"prefill_base_url": "http://127.0.0.1:1/v1", "decode_base_url": "http://127.0.0.1:2/v1"}
    publisher.publish(batch(stored([1, 2], None, IDS[:8])))
    if asynchronous:
        async with AsyncPDChatClient(**urls, api_key="x", kv_events=template) as client:
            client.pd_fleet.start()
            feeds = client.pd_fleet.kv_events
            assert feeds is not None
            deadline = time.monotonic() + 5
            while feeds.held_tokens(urls["decode_base_url"], KEYS, BS) != 8:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.02)
    else:
        with PDChatClient(**urls, api_key="x", kv_events=template) as client:
            client.pd_fleet.start()
            feeds = client.pd_fleet.kv_events
            assert feeds is not None
            wait_for(lambda: feeds.held_tokens(urls["decode_base_url"], KEYS, BS) == 8)
    assert {s.endpoint for s in feeds.sources()} == set()  # closed with its client
