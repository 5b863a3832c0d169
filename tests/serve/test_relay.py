"""A decode body relayed from the leg's reader (``transport._relay``) reaches a slow caller
whole and in order: when the caller's send must wait, the relay hands the body back to the
call's task, which waits for it and relays again. Real sockets: a real uvicorn server, the
stub's decode stream, and a caller that reads nothing for a while and then all of it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Generator
from typing import Any

import httpx
import orjson
import pytest

from pdclient.transport import _relay
from tests.stubserver import Fault, StubServer

from .conftest import config_for, running_proxy

WORD = "w" * 16_000
WORDS = [f"{i}:{WORD}" for i in range(600)]
"""~10 MB of events: more than the caller's socket, the proxy's (Linux's most, 4 MB) and its transport hold."""


def _raw_answer(url: str, body: bytes, pause: float) -> bytes:
    """A streamed call's whole HTTP answer, read only after ``pause`` seconds of reading nothing."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 16)
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        )
        sock.sendall(head.encode() + body)
        time.sleep(pause)
        parts = []
        while chunk := sock.recv(1 << 20):
            parts.append(chunk)
    return b"".join(parts)


def _events(answer: bytes) -> list[Any]:
    """The SSE events' data of a chunked HTTP answer, in order."""
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    parts, at = [], 0
    while True:
        line_end = body.index(b"\r\n", at)
        length = int(body[at:line_end], 16)
        if length == 0:
            break
        parts.append(body[line_end + 2 : line_end + 2 + length])
        at = line_end + 2 + length + 2
    events = [e.removeprefix(b"data: ") for e in b"".join(parts).split(b"\n\n") if e]
    return [e if e == b"[DONE]" else orjson.loads(e) for e in events]


def test_a_caller_that_reads_late_gets_every_event_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    waited: list[int] = []
    original = _relay.Waiting.__await__

    def counted(self: _relay.Waiting) -> Generator[Any, Any, None]:
        waited.append(1)
        return (yield from original(self))

    monkeypatch.setattr(_relay.Waiting, "__await__", counted)
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    with StubServer(words=WORDS) as stub, running_proxy(config_for(stub.url, remote_prefill="always")) as proxy:
        events = _events(_raw_answer(proxy.url, body, pause=1.0))
    assert events[-1] == b"[DONE]"
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1] if e["choices"])
    assert text == "".join(WORDS)
    assert waited, "the caller's send never had to wait: the test did not fill the buffers"


def test_a_decode_that_goes_silent_while_relayed_ends_at_the_read_timeout() -> None:
    """A relayed body waits on the leg's read deadline as a read does: the decode sends its
    first event and then nothing; the caller's stream is cut after the read timeout, not held."""
    gate = threading.Semaphore(0)  # never released: the stub holds its second event
    body = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True})
    with StubServer() as stub, running_proxy(config_for(stub.url, remote_prefill="always", timeout=0.5)) as proxy:
        stub.inject(Fault(event_gate=gate), leg="decode")
        started = time.monotonic()
        received = b""
        try:
            with (
                pytest.raises(httpx.RemoteProtocolError),  # the caller's stream is cut too
                httpx.stream("POST", proxy.url + "/v1/chat/completions", content=body, timeout=30) as response,
            ):
                for chunk in response.iter_bytes():
                    received += chunk
        finally:
            gate.release(100)  # the stub's thread goes on, and the server stops
        elapsed = time.monotonic() - started
    assert received.count(b"data: ") >= 1 and b"[DONE]" not in received
    assert 0.5 <= elapsed < 10
