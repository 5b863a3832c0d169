"""The fake vLLM (tests/fake_vllm.py) on a real loopback socket, for tests and benchmarks.

It answers as ``fake_vllm.VLLMAnswers`` does, over real sockets (HTTP/1.1, keep-alive),
so the code under test runs its true connection path, unlike a respx mock:

- POST ``/v1/chat/completions`` or ``/v1/completions`` whose body has
  ``kv_transfer_params.do_remote_decode`` is answered as a prefill: non-streamed JSON
  with ``prompt_token_ids`` (``prompt_tokens`` of them; top-level for chat,
  ``choices[0]`` for completions) and a NIXL-like ``kv_transfer_params`` dict;
- any other POST there is answered as a decode: an SSE stream of a few chunks when
  ``stream`` is true (chunked transfer encoding, one event per chunk), JSON otherwise;
- GET ``/v1/models`` lists one model; POST ``/v1/files`` answers a file object whose
  ``bytes`` is the length of the body it read (an upload passed through);
- GET ``/metrics`` answers vLLM-shaped Prometheus text: its own
  ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` (generation requests
  being answered / queued for a slot when ``max_running`` is set), a
  ``vllm:kv_cache_usage_perc`` (``StubServer.kv_usage``; by default running / max_running)
  and prefix-cache counters;
- POST ``/tokenize`` and ``/v1/chat/completions/render`` (``/v1/completions/render``) answer
  as vLLM 0.32 does (the prompt's ids; the rendered conversation and its engine prompt),
  after ``preprocess_ms_per_1k_tokens`` per thousand prompt tokens of sleep: the chat
  template and the tokenizer run on the server's own cores, which a router calling
  these endpoints waits for (vllm-router calls both on both servers per request).
  Default 0 (tests); the proxy benchmark uses 1.3 ms, vLLM 0.32's measured
  template+tokenize cost for SmolLM2 (2.72 ms at 2094 tokens, server_patch/README.md);
- GET ``/stub/counts``: requests served per path, for benchmarks (how many requests a
  router sends per call);
- GET ``/health`` answers 200 with no body, as vLLM's does, or 503 while ``StubServer.healthy`` is False;
- POST ``/stub/control`` sets ``healthy`` and ``kv_usage`` of a stub in another process
  (and empties its prefix cache with ``reset_prefix_cache``).

Load and cache models, for routing benchmarks (all off by default):

- ``max_running``: at most that many generation requests run at once, the rest wait;
- ``background``: slots held by someone else's requests (counted as running);
- ``step_seconds`` + ``step_per_running`` x running: the time of each streamed decode
  event (a batch step that slows as the batch grows);
- ``prefix_cache`` (``PrefixCacheModel``): the server renders each prefill's messages,
  finds the leading blocks it has cached (LRU, bounded), and spends
  ``seconds_per_char`` on every uncached character, one prefill at a time.

The first id of a prefill's ``prompt_token_ids`` is derived from the request's messages
(or prompt), so a decode can tell whether the ids it was given belong to its request:
``Received.ids_match``. Every request is recorded (``StubServer.received``) unless
``record=False``, and how each streamed answer ended (``StubServer.streams``: completed,
or the client closed its connection, seen at once while the stub waits between events);
faults (delay, status, dropped connection, stream cut short, events held back until a
test lets them go) are injected with ``StubServer.inject`` or a ``fault_hook``.

One server plays both roles (the body says which), so a "pair" may be one server or two.
In-process use::

    with StubServer(prompt_tokens=8192) as stub:
        client = PDChatClient(prefill_base_url=stub.url, decode_base_url=stub.url)

As a separate process (benchmarks, so the stub does not share the client's GIL)::

    python tests/stubserver.py --prompt-tokens 32768    # prints "READY http://127.0.0.1:PORT/v1"
    python tests/stubserver.py --prompt-tokens 2048 --preprocess-ms-per-1k-tokens 1.3
"""

from __future__ import annotations

import argparse
import contextlib
import select
import socket
import struct
import sys
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run as a script: python tests/stubserver.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fake_vllm import (
    MODEL,
    NIXL_BLOCK_SIZE,
    VOCAB,
    VLLMAnswers,
    chat_json,
    forwarded_ids,
    is_prefill,
    prefill_json,
    seed_of,
)

try:  # the stub should cost the client as little time as possible; orjson is a pdclient dependency
    import orjson

    def _loads(data: bytes) -> Any:
        return orjson.loads(data)

    def _dumps(value: Any) -> bytes:
        return orjson.dumps(value)

except ImportError:  # pragma: no cover - stdlib fallback
    import json

    def _loads(data: bytes) -> Any:
        return json.loads(data)

    def _dumps(value: Any) -> bytes:
        return json.dumps(value, separators=(",", ":")).encode()


if TYPE_CHECKING:
    from pytest import MonkeyPatch

DECODE_WORDS = ("Hello", " from", " the", " decode", " stub")
_PREPROCESS_PATHS = ("/tokenize", "/v1/chat/completions/render", "/v1/completions/render")


@dataclass(frozen=True)
class Fault:
    """How to misbehave on one request. Fields combine: delay first, then the rest."""

    delay: float = 0.0
    """Seconds to wait before answering (a slow server, or a client timeout)."""
    hold: float = 0.0
    """Seconds to wait before answering, watching the connection: a client that closes it
    ends the request there, recorded in ``streams`` as ``client closed`` after 0 events (a
    decode waiting for its KV, which vLLM aborts when its client goes away)."""
    status: int | None = None
    """Answer with this HTTP status and an OpenAI-style error body instead."""
    drop: bool = False
    """Close the connection without answering."""
    drop_after_events: int | None = None
    """Streamed decode: send this many SSE events, then close the connection mid-body."""
    reset: bool = False
    """With ``drop`` or ``drop_after_events``: reset the connection (RST, "connection reset
    by peer", as a killed server's kernel does) instead of closing it."""
    event_delay: float = 0.0
    """Streamed decode: seconds between SSE events."""
    drop_after_done: bool = False
    """Streamed decode: send every event and ``[DONE]``, then close without the chunked terminator."""
    event_gate: threading.Semaphore | None = None
    """Streamed decode: before each event after the first, wait (up to ``GATE_TIMEOUT``)
    until the test releases this once; so an event cannot leave before the test has seen
    the one before it."""


GATE_TIMEOUT = 10.0


@dataclass(frozen=True)
class StreamEnd:
    """How one streamed answer ended."""

    request_id: str | None
    events_sent: int
    """SSE events written, ``[DONE]`` included."""
    how: str
    """``completed``, ``client closed`` (the client went away mid-stream, or during a
    ``hold``), ``dropped`` (a ``drop_after_events`` fault) or ``gate timeout``."""
    at: float
    """``time.monotonic()`` when it ended."""


@dataclass(frozen=True)
class Received:
    """One request as the stub saw it."""

    leg: str
    """``prefill``, ``decode`` or ``other``."""
    method: str
    path: str
    headers: dict[str, str]
    """Lower-cased names."""
    body: Any
    """The parsed JSON body, or None."""
    client_port: int
    """The client's source port: equal across requests that reused one connection."""
    forwarded_ids: int | None = None
    """Decode: how many ``prompt_token_ids`` it was given (chat) or prompt ids (completions)."""
    ids_match: bool | None = None
    """Chat decode with ids: whether they are the ones a prefill of this request returns."""
    query: str = ""
    """The request's query string, without the ``?``."""
    raw_body: bytes = b""
    """The body's bytes as they arrived (a multipart upload's, say)."""


FaultHook = Callable[[Received], Fault | None]


def render(body: dict[str, Any]) -> str:
    """The stub's own chat template (ChatML-like): what its prefix cache sees of a request."""
    messages = body.get("messages")
    if not isinstance(messages, list):
        prompt = body.get("prompt")
        return prompt if isinstance(prompt, str) else ""
    parts = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        if isinstance(content, list):
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|im_start|>{message.get('role', '')}\n{content or ''}<|im_end|>\n")
    return "".join(parts) + "<|im_start|>assistant\n"


class PrefixCacheModel:
    """A server's prefix cache: chained block hashes in LRU order, ``capacity_chars`` at most.

    As vLLM frees a request's blocks tail first, a request's blocks are refreshed tail
    first, so eviction takes the ends of prompts before the prefixes they extend.
    """

    def __init__(self, *, capacity_chars: int = 400_000, block_chars: int = 64, seconds_per_char: float = 0.0) -> None:
        self.block_chars = block_chars
        self.capacity_blocks = max(1, capacity_chars // block_chars)
        self.seconds_per_char = seconds_per_char
        self.queried_chars = 0
        self.hit_chars = 0
        self.compute_seconds = 0.0
        """Time spent on uncached characters, all prefills together."""
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()
        self._compute = threading.Lock()

    def lookup_and_fill(self, text: str) -> tuple[int, int]:
        """(cached, total) characters of ``text``; it is cached afterwards."""
        size = self.block_chars
        data = text.encode()
        crc, hashes = 0, []
        for start in range(0, len(data) - size + 1, size):
            crc = zlib.crc32(data[start : start + size], crc)  # CRC of the whole prefix so far
            hashes.append(crc | (start << 32))  # and its length: a 64-bit name for the prefix
        with self._lock:
            hit = 0
            for h in hashes:
                if h not in self._blocks:
                    break
                hit += 1
            for h in reversed(hashes):
                self._blocks[h] = None
                self._blocks.move_to_end(h)
            while len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)
            cached = hit * size
            self.queried_chars += len(text)
            self.hit_chars += cached
        return cached, len(text)

    def prefill(self, text: str) -> None:
        """Look ``text`` up and spend the time its uncached part costs, one prefill at a time."""
        cached, total = self.lookup_and_fill(text)
        if self.seconds_per_char and total > cached:
            seconds = (total - cached) * self.seconds_per_char
            with self._compute:
                self.compute_seconds += seconds
                time.sleep(seconds)


@dataclass
class _Injected:
    fault: Fault
    leg: str | None
    times: int


_CLOSED_PORTS: list[socket.socket] = []
"""Bound, never listening, held for the test run: a port released at once could be the next
free one the kernel hands out (to a proxy under test, say), and then something answers."""


def closed_port_url() -> str:
    """A loopback base URL nothing listens on: connections are refused at once (a server down)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    _CLOSED_PORTS.append(sock)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1"


class _ForwardProxy(BaseHTTPRequestHandler):
    """A forward proxy that answers every request itself, recording the absolute URLs it was asked for."""

    seen: list[str]

    def do_POST(self) -> None:
        self.server.seen.append(self.path)  # type: ignore[attr-defined]
        body = _loads(self.rfile.read(int(self.headers["content-length"])))
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            payload = prefill_json(body)
        else:
            payload = chat_json("via proxy")
        data = _dumps(payload)
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def forward_proxy(monkeypatch: MonkeyPatch) -> Iterator[list[str]]:
    """A forward proxy on loopback named by ``HTTP_PROXY`` (no ``NO_PROXY``), answering every
    request itself (a prefill's as the fake vLLM does, else "via proxy"); yields the URLs it was asked for."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ForwardProxy)
    server.seen = []  # type: ignore[attr-defined]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{server.server_address[1]}")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        yield server.seen  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()


def _leg(body: Any) -> str:
    return "prefill" if is_prefill(body) else "decode"


class StubServer:
    """The stub, on 127.0.0.1 with an ephemeral port, served from a background thread."""

    def __init__(
        self,
        *,
        prompt_tokens: int = 64,
        host: str = "127.0.0.1",
        port: int = 0,
        record: bool = True,
        max_running: int | None = None,
        step_seconds: float = 0.0,
        step_per_running: float = 0.0,
        prefix_cache: PrefixCacheModel | None = None,
        preprocess_ms_per_1k_tokens: float = 0.0,
        words: Sequence[str] = DECODE_WORDS,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.words = tuple(words)
        """The decode's answer, one token per item."""
        self.record = record
        self.preprocess_ms_per_1k_tokens = preprocess_ms_per_1k_tokens
        self.counts: dict[str, int] = {}
        """Requests served per path (``GET /stub/counts``)."""
        self.fault_hook: FaultHook | None = None
        self.set_cookie: str | None = None
        """A ``Set-Cookie`` value for every JSON answer (a load balancer's sticky-session cookie, say)."""
        self.healthy = True
        """False: /health answers 503 (vLLM's answer once its engine is dead)."""
        self.kv_usage: float | None = None
        """What /metrics says of KV-cache usage (0..1); None: running / max_running (0 without
        slots), as a server whose cache holds ``max_running`` requests would."""
        self.max_running = max_running
        self.step_seconds = step_seconds
        self.step_per_running = step_per_running
        self.prefix_cache = prefix_cache
        self.background = 0
        """Slots held by someone else's long requests (another tenant, a client that is not
        ours): counted as running, they slow every step and leave fewer slots."""
        self._running = 0
        self._waiting = 0
        self._slots = threading.Condition()
        self._received: list[Received] = []
        self._streams: list[StreamEnd] = []
        self._injected: list[_Injected] = []
        self._lock = threading.Lock()
        self._tails: dict[int, list[int]] = {}
        self._httpd = _Server((host, port), _Handler)
        self._httpd.stub = self  # type: ignore[attr-defined]
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def url(self) -> str:
        """The OpenAI base URL, ``http://HOST:PORT/v1``."""
        return f"http://{self.host}:{self.port}/v1"

    def start(self) -> StubServer:
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.05,), name="stubserver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> StubServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- assertions and faults -------------------------------------------------------

    @property
    def received(self) -> list[Received]:
        with self._lock:
            return list(self._received)

    def legs(self, leg: str) -> list[Received]:
        return [r for r in self.received if r.leg == leg]

    @property
    def streams(self) -> list[StreamEnd]:
        with self._lock:
            return list(self._streams)

    def _stream_ended(self, request_id: str | None, events_sent: int, how: str) -> None:
        with self._lock:
            self._streams.append(StreamEnd(request_id, events_sent, how, time.monotonic()))

    def clear(self) -> None:
        with self._lock:
            self._received.clear()
            self._streams.clear()
            self._injected.clear()
            self.counts.clear()

    def inject(self, fault: Fault, *, leg: str | None = None, times: int = 1) -> None:
        """Apply ``fault`` to the next ``times`` requests of ``leg`` (any leg if None)."""
        with self._lock:
            self._injected.append(_Injected(fault, leg, times))

    def _fault_for(self, received: Received) -> Fault | None:
        with self._lock:
            if not received.path.startswith("/stub/"):
                self.counts[received.path] = self.counts.get(received.path, 0) + 1
            if self.record:
                self._received.append(received)
            for injected in self._injected:
                if injected.leg is None or injected.leg == received.leg:
                    injected.times -= 1
                    if injected.times <= 0:
                        self._injected.remove(injected)
                    return injected.fault
        return self.fault_hook(received) if self.fault_hook is not None else None

    # -- load model --------------------------------------------------------------------

    @property
    def running(self) -> int:
        return self._running + self.background

    @property
    def waiting(self) -> int:
        return self._waiting

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        """One generation request: it waits for a slot when ``max_running`` are taken."""
        with self._slots:
            self._waiting += 1
            try:
                while self.max_running is not None and self.running >= self.max_running:
                    self._slots.wait()
            finally:
                self._waiting -= 1
            self._running += 1
        try:
            yield
        finally:
            with self._slots:
                self._running -= 1
                self._slots.notify()

    def kv_usage_now(self) -> float:
        if self.kv_usage is not None:
            return float(self.kv_usage)
        return min(1.0, self.running / self.max_running) if self.max_running else 0.0

    def step_delay(self) -> float:
        """Seconds one decode step (one streamed event) takes with the current batch."""
        return self.step_seconds + self.step_per_running * self.running

    def metrics_text(self) -> str:
        """A vLLM 0.32-shaped /metrics answer (vllm/v1/metrics/loggers.py names and labels)."""
        labels = f'{{engine="0",model_name="{MODEL}"}}'
        cache = self.prefix_cache
        queried, hits = (cache.queried_chars, cache.hit_chars) if cache is not None else (0, 0)
        return (
            "# HELP python_gc_objects_collected_total Objects collected during gc\n"
            "# TYPE python_gc_objects_collected_total counter\n"
            'python_gc_objects_collected_total{generation="0"} 1234.0\n'
            "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
            "# TYPE vllm:num_requests_running gauge\n"
            f"vllm:num_requests_running{labels} {float(self.running)}\n"
            "# HELP vllm:num_requests_waiting Number of requests waiting to be processed.\n"
            "# TYPE vllm:num_requests_waiting gauge\n"
            f"vllm:num_requests_waiting{labels} {float(self._waiting)}\n"
            "# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.\n"
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f"vllm:kv_cache_usage_perc{labels} {self.kv_usage_now()}\n"
            "# HELP vllm:prefix_cache_queries_total Prefix cache queries (the stub counts characters).\n"
            "# TYPE vllm:prefix_cache_queries_total counter\n"
            f"vllm:prefix_cache_queries_total{labels} {float(queried)}\n"
            "# HELP vllm:prefix_cache_hits_total Prefix cache hits (the stub counts characters).\n"
            "# TYPE vllm:prefix_cache_hits_total counter\n"
            f"vllm:prefix_cache_hits_total{labels} {float(hits)}\n"
            "# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.\n"
            "# TYPE vllm:e2e_request_latency_seconds histogram\n"
            f'vllm:e2e_request_latency_seconds_bucket{{engine="0",le="+Inf",model_name="{MODEL}"}} 0.0\n'
        )

    # -- answers ---------------------------------------------------------------------

    def prompt_ids(self, body: dict[str, Any]) -> list[int]:
        """The ids a prefill of ``body`` returns: its seed, then a fixed tail."""
        n = self.prompt_tokens
        tail = self._tails.get(n)
        if tail is None:
            tail = self._tails[n] = [(i * 2_654_435_761) % VOCAB for i in range(1, n)]
        return [seed_of(body), *tail]

    def _kv_params(self, request_id: str, n_ids: int) -> dict[str, Any]:
        blocks = (n_ids + NIXL_BLOCK_SIZE - 1) // NIXL_BLOCK_SIZE
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": list(range(1000, 1000 + blocks)),
            "remote_engine_id": "stub-prefill-engine-0",
            "remote_request_id": request_id,
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "tp_size": 1,
        }

    @property
    def answers(self) -> VLLMAnswers:
        return VLLMAnswers(
            ids=self.prompt_ids,
            text=lambda body: "".join(self.words),
            pieces=lambda text: list(self.words),
            kv_params=self._kv_params,
        )


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    # The listen backlog, as uvicorn's (vLLM's); socketserver's 5 resets connections under load.
    request_queue_size = 2048

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client closing its connection is normal (openai closes a stream at [DONE]).
        if not isinstance(sys.exc_info()[1], ConnectionError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: every answer has a length or is chunked
    disable_nagle_algorithm = True  # small SSE writes must not wait for delayed ACKs
    server_version = "pdclient-stub/1"
    sys_version = ""

    @property
    def stub(self) -> StubServer:
        return self.server.stub  # type: ignore[attr-defined,no-any-return]

    def log_message(self, format: str, *args: Any) -> None:
        pass  # quiet: tests and benchmarks read stdout

    # -- reading ---------------------------------------------------------------------

    def _read_body(self) -> bytes:
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            parts: list[bytes] = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(parts)
                parts.append(self.rfile.read(size))
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("content-length") or 0))

    def _received(self, leg: str, body: Any, path: str, raw_body: bytes = b"") -> Received:
        forwarded = ids_match = None
        if leg == "decode" and isinstance(body, dict):
            ids = forwarded_ids(path, body)
            if ids is not None:
                forwarded = len(ids)
                if path.endswith("/chat/completions"):  # a completions decode no longer has its text prompt
                    ids_match = bool(ids) and ids[0] == seed_of(body)
        return Received(
            leg=leg,
            method=self.command,
            path=path,
            headers={k.lower(): v for k, v in self.headers.items()},
            body=body,
            client_port=int(self.client_address[1]),
            forwarded_ids=forwarded,
            ids_match=ids_match,
            query=self.path.partition("?")[2],
            raw_body=raw_body,
        )

    # -- writing ---------------------------------------------------------------------

    def _send(self, status: int, payload: Any, request_id: str | None = None) -> None:
        data = _dumps(payload)
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        if request_id:
            self.send_header("x-request-id", request_id)
        if self.stub.set_cookie:
            self.send_header("set-cookie", self.stub.set_cookie)
        self.end_headers()
        self.wfile.write(data)

    def _send_text(self, status: int, text: str, content_type: str = "text/plain") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("content-type", content_type)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message, "type": "stub_error", "code": status}})

    def _drop(self, reset: bool = False) -> None:
        self.close_connection = True
        if reset:
            with contextlib.suppress(OSError):
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
            return
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def _stream(self, events: list[dict[str, Any]], fault: Fault | None, request_id: str | None) -> None:
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("cache-control", "no-cache")
        self.send_header("transfer-encoding", "chunked")
        if request_id:
            self.send_header("x-request-id", request_id)
        self.end_headers()
        frames = [b"data: " + _dumps(event) + b"\n\n" for event in events]
        frames.append(b"data: [DONE]\n\n")
        for i, frame in enumerate(frames):
            if fault is not None and fault.drop_after_events is not None and i >= fault.drop_after_events:
                self._drop(fault.reset)
                self.stub._stream_ended(request_id, i, "dropped")
                return
            if i and self.stub.step_delay():
                time.sleep(self.stub.step_delay())
            stopped = self._wait_before_event(fault) if i and fault is not None else None
            # [DONE] and the body's end in one write (unless the fault is to leave the end out).
            last = i == len(frames) - 1 and not (fault and fault.drop_after_done)
            end = b"0\r\n\r\n" if last else b""
            if stopped is None:
                try:
                    self.wfile.write(b"%x\r\n%s\r\n%s" % (len(frame), frame, end))
                except OSError:
                    stopped = "client closed"
            if stopped is not None:
                self.close_connection = True
                self.stub._stream_ended(request_id, i, stopped)
                return
        if fault is not None and fault.drop_after_done:
            self.wfile.flush()
            self._drop()
        self.stub._stream_ended(request_id, len(frames), "completed")

    def _wait_before_event(self, fault: Fault) -> str | None:
        """Wait as the fault says; why the stream must stop (the client left), or None."""
        if self._client_left_within(fault.event_delay):
            return "client closed"
        if fault.event_gate is not None:
            give_up = time.monotonic() + GATE_TIMEOUT
            while not fault.event_gate.acquire(timeout=0.02):
                if self._client_gone(0):
                    return "client closed"
                if time.monotonic() > give_up:
                    return "gate timeout"
        return None

    def _client_left_within(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self._client_gone(min(left, 0.05)):
                return True
        return False

    def _client_gone(self, timeout: float) -> bool:
        """Whether the client closed its end (waiting up to ``timeout`` for a sign of it)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], timeout)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    # -- routes ----------------------------------------------------------------------

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        fault = self.stub._fault_for(self._received("other", None, path))
        if self._faulted(fault):
            return
        if path == "/v1/models":
            self._send(200, VLLMAnswers.models())
        elif path == "/health":  # as vLLM's: 200, empty body (routers poll it before routing)
            if self.stub.healthy:
                self._send_text(200, "")
            else:
                self._error(503, "engine dead (stub)")
        elif path == "/metrics":
            self._send_text(200, self.stub.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/stub/counts":
            with self.stub._lock:
                self._send(200, dict(self.stub.counts))
        else:
            self._error(404, f"no route GET {path}")

    def do_POST(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/")
        raw = self._read_body()
        try:
            body = _loads(raw) if raw else None
        except ValueError:
            body = None
        routed = path in ("/v1/chat/completions", "/v1/completions")
        leg = _leg(body) if routed else "other"
        received = self._received(leg, body, path, raw)
        fault = self.stub._fault_for(received)
        if self._faulted(fault):
            return
        if path in _PREPROCESS_PATHS and isinstance(body, dict):
            self._preprocess(path, body)
            return
        if path == "/stub/control" and isinstance(body, dict):
            self.stub.healthy = bool(body.get("healthy", self.stub.healthy))
            if "kv_usage" in body:
                self.stub.kv_usage = None if body["kv_usage"] is None else float(body["kv_usage"])
            cache = self.stub.prefix_cache
            if body.get("reset_prefix_cache") and cache is not None:
                capacity = cache.capacity_blocks * cache.block_chars
                self.stub.prefix_cache = PrefixCacheModel(
                    capacity_chars=capacity, block_chars=cache.block_chars, seconds_per_char=cache.seconds_per_char
                )
            self._send(200, {"healthy": self.stub.healthy, "kv_usage": self.stub.kv_usage})
            return
        if path == "/v1/files":  # an upload (multipart): what a file object says of the bytes read
            file = {"id": "file-stub", "object": "file", "bytes": len(raw), "created_at": 0, "filename": "upload"}
            self._send(200, {**file, "purpose": "batch", "status": "processed"})
            return
        if not routed:
            self._error(404, f"no route POST {path}")
            return
        if not isinstance(body, dict):
            self._error(400, "body is not a JSON object")
            return
        with self.stub.slot():
            self._generate(path, body, leg, received, fault)

    def _generate(self, path: str, body: dict[str, Any], leg: str, received: Received, fault: Fault | None) -> None:
        request_id = self.headers.get("x-request-id")
        answers = self.stub.answers
        if leg == "prefill":
            if self.stub.prefix_cache is not None:
                self.stub.prefix_cache.prefill(render(body))
            self._send(200, answers.prefill(path, body, request_id or "stub"), request_id)
        elif body.get("stream"):
            self._stream(answers.decode_events(path, body), fault, request_id)
        else:
            steps = len(DECODE_WORDS) * self.stub.step_delay()
            if steps:
                time.sleep(steps)
            self._send(200, answers.decode(path, body), request_id)

    def _preprocess(self, path: str, body: dict[str, Any]) -> None:
        """vLLM's /tokenize and /render: the prompt's ids, after the template and tokenizer's time."""
        ids = self.stub.prompt_ids(body)
        cost = self.stub.preprocess_ms_per_1k_tokens * len(ids) / 1e6
        if cost:
            time.sleep(cost)
        if path == "/tokenize":
            self._send(200, {"count": len(ids), "max_model_len": 32768, "tokens": ids, "token_strs": None})
        elif path == "/v1/chat/completions/render":
            self._send(200, [body.get("messages", []), [{"type": "token", "prompt_token_ids": ids}]])
        else:
            self._send(200, [{"type": "token", "prompt_token_ids": ids}])

    def _faulted(self, fault: Fault | None) -> bool:
        """Apply the parts of a fault that happen before an answer; True if it ends here."""
        if fault is None:
            return False
        if fault.delay:
            time.sleep(fault.delay)
        if self._client_left_within(fault.hold):
            self.close_connection = True
            self.stub._stream_ended(self.headers.get("x-request-id"), 0, "client closed")
            return True
        if fault.drop:
            self._drop(fault.reset)
            return True
        if fault.status is not None:
            self._error(fault.status, f"injected HTTP {fault.status}")
            return True
        return False


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the vLLM P/D stub until stdin closes or the process is killed.")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="ids a prefill answers with")
    parser.add_argument("--port", type=int, default=0, help="0: an ephemeral port")
    parser.add_argument("--host", default="127.0.0.1", help="any 127.0.0.x works on Linux")
    parser.add_argument("--max-running", type=int, default=None, help="generation slots; more requests wait")
    parser.add_argument("--step-seconds", type=float, default=0.0, help="base time of a decode step (SSE event)")
    parser.add_argument("--step-per-running", type=float, default=0.0, help="added per running request")
    parser.add_argument(
        "--answer-tokens", type=int, default=len(DECODE_WORDS), help="SSE events (tokens) a streamed decode sends"
    )
    parser.add_argument("--background", type=int, default=0, help="slots held by another tenant's requests")
    parser.add_argument("--prefix-cache-chars", type=int, default=0, help="model a prefix cache of this size")
    parser.add_argument("--prefix-block-chars", type=int, default=64)
    parser.add_argument("--prefill-seconds-per-char", type=float, default=0.0, help="cost of an uncached character")
    parser.add_argument(
        "--preprocess-ms-per-1k-tokens",
        type=float,
        default=0.0,
        help="time /tokenize and /render take per 1000 prompt tokens (vLLM 0.32, SmolLM2: 1.3)",
    )
    args = parser.parse_args(argv)
    cache = None
    if args.prefix_cache_chars:
        cache = PrefixCacheModel(
            capacity_chars=args.prefix_cache_chars,
            block_chars=args.prefix_block_chars,
            seconds_per_char=args.prefill_seconds_per_char,
        )
    server = StubServer(
        prompt_tokens=args.prompt_tokens,
        host=args.host,
        port=args.port,
        record=False,
        max_running=args.max_running,
        step_seconds=args.step_seconds,
        step_per_running=args.step_per_running,
        prefix_cache=cache,
        preprocess_ms_per_1k_tokens=args.preprocess_ms_per_1k_tokens,
        words=[DECODE_WORDS[i % len(DECODE_WORDS)] for i in range(args.answer_tokens)],
    )
    server.background = args.background
    server.start()
    print(f"READY {server.url}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        sys.stdin.read()  # the parent closing our stdin (or dying) ends the stub
    server.stop()


if __name__ == "__main__":
    main()
