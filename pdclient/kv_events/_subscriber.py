"""One endpoint's event subscription: a thread reading its publisher into its ``KVIndex``.

A ZMQ SUB socket on the publisher, a DEALER on its replay socket, and a monitor of the
SUB socket's connection: on each (re)connect the subscriber asks for a replay from
sequence 0 (vLLM sends what its buffer holds, then an end marker), and live messages
that arrive meanwhile wait for it. ZMQ heartbeats make a publisher that stops answering
(a host gone, a network cut) a disconnect within ``HEARTBEAT_TIMEOUT_MS``. pyzmq is the
``pdclient[kv-events]`` extra.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from .._errors import PDConfigError
from ._index import Feed, KVIndex, View

logger = logging.getLogger("pdclient.kv_events")

HEARTBEAT_IVL_MS = 500
HEARTBEAT_TIMEOUT_MS = 1500
REPLAY_TIMEOUT_S = 5.0
"""A replay not ended within this is given up, and asked again ``RETRY_S`` later."""
RETRY_S = 2.0
SUBSCRIBE_SETTLE_S = 0.2
"""Seconds from a (re)connect to the replay request: ZMQ delivers the subscription to the
publisher asynchronously, so messages sent meanwhile are dropped (the slow joiner)."""
_POLL_MS = 50
_MAX_HELD = 100_000
"""Live messages kept while a replay runs (vLLM's default ``hwm``); beyond, a new replay."""
_END_SEQ = -1


def import_zmq() -> Any:
    try:
        import zmq
        import zmq.utils.monitor
    except ImportError as exc:
        raise PDConfigError("kv_events needs pyzmq, which is not installed: pip install 'pdclient[kv-events]'") from exc
    return zmq


@dataclass(frozen=True)
class KVEventSource:
    """Where one endpoint publishes its KV events."""

    endpoint: str
    """The API endpoint the events are of (as the pools name it)."""
    publisher: str
    """The PUB socket's address, ``tcp://host:port``."""
    replay: str | None = None
    """The replay (ROUTER) socket's address; None: the publisher has none, so a view that
    missed messages stays unknown until the server's cache is cleared or it restarts."""
    topic: str = ""


class Subscriber:
    """Reads one ``KVEventSource`` into a ``KVIndex`` on a daemon thread until ``close``."""

    def __init__(self, source: KVEventSource, index: KVIndex) -> None:
        self.source = source
        self.index = index
        self._zmq = import_zmq()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"pdclient-kv-events {source.endpoint}", daemon=True)
        self.messages = 0
        """Messages applied or replayed (for tests and stats)."""

    def start(self) -> Subscriber:
        self._thread.start()
        return self

    def close(self, timeout: float = 2.0) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self._loop()
        except Exception:
            logger.exception("KV event subscriber of %s failed", self.source.endpoint)
            self.index.mark_behind("the subscriber failed (see the log)")

    def _loop(self) -> None:
        zmq = self._zmq
        ctx = zmq.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.RECONNECT_IVL, 200)
        sub.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        sub.setsockopt(zmq.SUBSCRIBE, self.source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(self.source.publisher)
        dealer = None
        replay_deadline: float | None = None
        held: list[tuple[int, bytes]] = []
        connected = False
        replay_at: float | None = None
        next_retry = 0.0
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)

        def ask_replay() -> None:
            nonlocal dealer, replay_deadline
            if self.source.replay is None:
                return
            if dealer is not None:
                poller.unregister(dealer)
                dealer.close(linger=0)
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(self.source.replay)
            poller.register(dealer, zmq.POLLIN)
            self.index.begin_replay()
            held.clear()
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            replay_deadline = time.monotonic() + REPLAY_TIMEOUT_S

        def live(seq: int, payload: bytes) -> None:
            nonlocal next_retry
            if self.index.feed(seq, payload) is Feed.GAP:
                if self.source.replay is None:
                    self.index.lose_at(seq, f"missed messages before {seq}, and the publisher has no replay socket")
                    self.index.feed(seq, payload)
                elif replay_deadline is None:
                    ask_replay()
                    held.append((seq, payload))

        try:
            while not self._stop.is_set():
                ready = dict(poller.poll(_POLL_MS))
                if monitor in ready:
                    event = zmq.utils.monitor.recv_monitor_message(monitor)
                    if event["event"] == zmq.EVENT_CONNECTED:
                        connected = True
                        # After the subscription has reached the publisher: a message it
                        # sends before then is dropped, and only a replay asked later has it.
                        replay_at = time.monotonic() + SUBSCRIBE_SETTLE_S
                    elif event["event"] == zmq.EVENT_DISCONNECTED:
                        connected = False
                        self.index.mark_behind("the publisher disconnected or went silent")
                if sub in ready:
                    while True:
                        try:
                            frames = sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if len(frames) != 3:
                            continue
                        seq = int.from_bytes(frames[1], "big", signed=True)
                        self.messages += 1
                        if replay_deadline is not None:
                            if len(held) < _MAX_HELD:
                                held.append((seq, frames[2]))
                        else:
                            live(seq, frames[2])
                if dealer is not None and dealer in ready:
                    while True:
                        try:
                            frames = dealer.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        if len(frames) != 4:
                            continue
                        seq = int.from_bytes(frames[2], "big", signed=True)
                        if seq == _END_SEQ:
                            self.index.end_replay()
                            replay_deadline = None
                            for seq_held, payload in held:
                                live(seq_held, payload)
                            held.clear()
                            break
                        self.messages += 1
                        self.index.feed_replayed(seq, frames[3])
                now = time.monotonic()
                if replay_at is not None and now >= replay_at:
                    replay_at = None
                    if self.source.replay is not None:
                        ask_replay()
                if replay_deadline is not None and now > replay_deadline:
                    self.index.abort_replay(f"no replay from {self.source.replay} within {REPLAY_TIMEOUT_S} s")
                    replay_deadline, next_retry = None, now + RETRY_S
                    held.clear()
                elif (
                    replay_deadline is None
                    and connected
                    and self.index.view is View.BEHIND
                    and self.source.replay is not None
                    and now > next_retry
                ):
                    next_retry = now + RETRY_S
                    ask_replay()
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)
            if dealer is not None:
                dealer.close(linger=0)
