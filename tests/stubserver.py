"""The fake vLLM (tests/fake_vllm.py) on a real loopback socket, for tests and benchmarks.

It answers as ``fake_vllm.VLLMAnswers`` does, over real sockets (HTTP/1.1, keep-alive),
so the code under test runs its true connection path, unlike a respx mock:

- POST ``/v1/chat/completions`` or ``/v1/completions`` whose body has
  ``kv_transfer_params.do_remote_decode`` is answered as a prefill: non-streamed JSON
  with ``prompt_token_ids`` (``prompt_tokens`` of them; top-level for chat,
  ``choices[0]`` for completions) and a NIXL-like ``kv_transfer_params`` dict;
- any other POST there is answered as a decode: an SSE stream of a few chunks when
  ``stream`` is true (chunked transfer encoding, one event per chunk), JSON otherwise;
- GET ``/v1/models`` lists one model; GET ``/health`` answers 200 with no body, as vLLM's does.

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: python tests/stubserver.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.fake_vllm import NIXL_BLOCK_SIZE, VOCAB, VLLMAnswers, forwarded_ids, is_prefill, seed_of

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


DECODE_WORDS = ("Hello", " from", " the", " decode", " stub")


@dataclass(frozen=True)
class Fault:
    """How to misbehave on one request. Fields combine: delay first, then the rest."""

    delay: float = 0.0
    """Seconds to wait before answering (a slow server, or a client timeout)."""
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
    """``completed``, ``client closed`` (the client went away mid-stream), ``dropped``
    (a ``drop_after_events`` fault) or ``gate timeout``."""
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


FaultHook = Callable[[Received], Fault | None]


@dataclass
class _Injected:
    fault: Fault
    leg: str | None
    times: int


def closed_port_url() -> str:
    """A loopback base URL nothing listens on: connections are refused at once (a server down)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


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
        words: Sequence[str] = DECODE_WORDS,
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.words = tuple(words)
        """The decode's answer, one token per item."""
        self.record = record
        self.fault_hook: FaultHook | None = None
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
    def url(self) -> str:
        """The OpenAI base URL, ``http://127.0.0.1:PORT/v1``."""
        return f"http://127.0.0.1:{self.port}/v1"

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

    def inject(self, fault: Fault, *, leg: str | None = None, times: int = 1) -> None:
        """Apply ``fault`` to the next ``times`` requests of ``leg`` (any leg if None)."""
        with self._lock:
            self._injected.append(_Injected(fault, leg, times))

    def _fault_for(self, received: Received) -> Fault | None:
        with self._lock:
            if self.record:
                self._received.append(received)
            for injected in self._injected:
                if injected.leg is None or injected.leg == received.leg:
                    injected.times -= 1
                    if injected.times <= 0:
                        self._injected.remove(injected)
                    return injected.fault
        return self.fault_hook(received) if self.fault_hook is not None else None

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

    def _received(self, leg: str, body: Any, path: str) -> Received:
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
        )

    # -- writing ---------------------------------------------------------------------

    def _send(self, status: int, payload: Any, request_id: str | None = None) -> None:
        data = _dumps(payload)
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        if request_id:
            self.send_header("x-request-id", request_id)
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
        deadline = time.monotonic() + fault.event_delay
        while (left := deadline - time.monotonic()) > 0:
            if self._client_gone(min(left, 0.05)):
                return "client closed"
        if fault.event_gate is not None:
            give_up = time.monotonic() + GATE_TIMEOUT
            while not fault.event_gate.acquire(timeout=0.02):
                if self._client_gone(0):
                    return "client closed"
                if time.monotonic() > give_up:
                    return "gate timeout"
        return None

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
        if path == "/health":  # as vLLM's: 200, empty body (routers poll it before routing)
            self.send_response(200)
            self.send_header("content-length", "0")
            self.end_headers()
        elif path == "/v1/models":
            self._send(200, VLLMAnswers.models())
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
        received = self._received(leg, body, path)
        fault = self.stub._fault_for(received)
        if self._faulted(fault):
            return
        if not routed:
            self._error(404, f"no route POST {path}")
            return
        if not isinstance(body, dict):
            self._error(400, "body is not a JSON object")
            return
        request_id = self.headers.get("x-request-id")
        answers = self.stub.answers
        if leg == "prefill":
            self._send(200, answers.prefill(path, body, request_id or "stub"), request_id)
        elif body.get("stream"):
            self._stream(answers.decode_events(path, body), fault, request_id)
        else:
            self._send(200, answers.decode(path, body), request_id)

    def _faulted(self, fault: Fault | None) -> bool:
        """Apply the parts of a fault that happen before an answer; True if it ends here."""
        if fault is None:
            return False
        if fault.delay:
            time.sleep(fault.delay)
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
    args = parser.parse_args(argv)
    server = StubServer(prompt_tokens=args.prompt_tokens, port=args.port, record=False).start()
    print(f"READY {server.url}", flush=True)
    with contextlib.suppress(KeyboardInterrupt):
        sys.stdin.read()  # the parent closing our stdin (or dying) ends the stub
    server.stop()


if __name__ == "__main__":
    main()
