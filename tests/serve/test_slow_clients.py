"""Slow or many clients cannot hold the proxy's connections: a request's head and body have
deadlines, a head has a size limit, idle and concurrent connections are bounded. Real
sockets against a real server (uvicorn as ``pdclient serve`` runs it, and the process)."""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pdclient.serve import ServeConfig
from pdclient.serve._protocol import HttpToolsConnection
from pdclient.serve._run import server_config
from tests.stubserver import Fault, StubServer

from .conftest import RunningProxy, ServeProcess, config_for, running_proxy

HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
PROTOCOLS = pytest.mark.parametrize("protocol", [HttpToolsConnection], ids=["httptools"])


@contextlib.contextmanager
def connection(url: str) -> Iterator[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        yield sock


def closed_by_peer(sock: socket.socket, wait: float = 0.0) -> bool:
    """Whether the server closed the connection (within ``wait`` seconds); an answer it sent
    first is read and dropped."""
    deadline = time.monotonic() + wait
    while True:
        readable, _, _ = select.select([sock], [], [], max(0.0, deadline - time.monotonic()))
        if not readable:
            return False
        try:
            if not sock.recv(65536):
                return True
        except ConnectionError:
            return True


def drip(sock: socket.socket, data: bytes, every: float, limit: float) -> float | None:
    """Send ``data`` a byte at a time; the seconds until the server closed the connection,
    or None if it was still open after ``limit`` seconds (or all was sent)."""
    started = time.monotonic()
    for byte in data:
        try:
            sock.sendall(bytes([byte]))
        except OSError:  # reset, or a broken pipe: closed
            return time.monotonic() - started
        if closed_by_peer(sock, every):
            return time.monotonic() - started
        if time.monotonic() - started > limit:
            return None
    return None


def answer(sock: socket.socket) -> tuple[int, bytes]:
    """The status and the rest of one answer read until the server closes the connection."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return int(data.split(b" ", 2)[1]), data


def serve(stub: StubServer, protocol: type, **settings: Any) -> contextlib.AbstractContextManager[RunningProxy]:
    return running_proxy(config_for(stub.url, **settings), server_options={"http": protocol})


# -- a request's head ----------------------------------------------------------------------


def test_a_process_closes_a_connection_dripping_its_headers(stub: StubServer) -> None:
    """The reported case, on `pdclient serve` itself: one byte per 0.25 s, closed by the deadline."""
    proxy = ServeProcess("--prefill", stub.url, "--decode", stub.url, "--header-timeout", "1", "--api-key", "k")
    try:
        with connection(proxy.url) as sock:
            closed_after = drip(sock, HEAD * 10, every=0.25, limit=6)
    finally:
        proxy.stop()
    assert closed_after is not None and 0.9 < closed_after < 3, closed_after
    assert stub.received == []


@PROTOCOLS
def test_a_dripping_head_is_cut_off_at_its_deadline(stub: StubServer, protocol: type) -> None:
    with serve(stub, protocol, header_timeout=0.6) as proxy, connection(proxy.url) as sock:
        closed_after = drip(sock, HEAD * 10, every=0.1, limit=4)
    assert closed_after is not None and 0.5 < closed_after < 2, closed_after


@PROTOCOLS
def test_a_silent_connection_is_closed(stub: StubServer, protocol: type) -> None:
    with serve(stub, protocol, header_timeout=0.5) as proxy, connection(proxy.url) as sock:
        assert closed_by_peer(sock, wait=3)


@PROTOCOLS
def test_the_deadline_is_per_request_and_spares_slow_answers(stub: StubServer, protocol: type) -> None:
    """Each head on a kept-alive connection has its own deadline; time spent answering (or
    between requests) is not a head's."""
    with serve(stub, protocol, header_timeout=0.5, keep_alive_timeout=5) as proxy, connection(proxy.url) as sock:
        for _ in range(3):
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(0.4)  # idle between requests: the keep-alive timeout's business, not the head's
        assert not closed_by_peer(sock, wait=0.3)


@PROTOCOLS
def test_a_slow_answer_and_a_body_in_time_are_not_cut(stub: StubServer, protocol: type) -> None:
    """The deadlines bound the request's arrival, never the answer's."""
    stub.inject(Fault(delay=1.2), leg="decode")
    body = b'{"model": "m", "messages": [{"role": "user", "content": "Say hello."}]}'
    with serve(stub, protocol, header_timeout=0.8, body_timeout=0.8) as proxy, connection(proxy.url) as sock:
        sock.sendall(HEAD + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 20):  # the body in four pieces, within its deadline
            time.sleep(0.1)
            sock.sendall(body[i : i + 20])
        status, response = answer(sock)
    assert status == 200 and b"Hello" in response


@PROTOCOLS
def test_an_oversized_head_is_refused(stub: StubServer, protocol: type) -> None:
    with serve(stub, protocol, max_header_size=4096) as proxy, connection(proxy.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\nX-Big: " + b"a" * 8192)
        status, _ = answer(sock)
    assert status == 431
    assert stub.received == []


# -- a request's body ----------------------------------------------------------------------


@PROTOCOLS
def test_a_dripping_body_gets_a_408_and_the_connection_closes(stub: StubServer, protocol: type) -> None:
    with serve(stub, protocol, body_timeout=0.8) as proxy, connection(proxy.url) as sock:
        started = time.monotonic()
        sock.sendall(HEAD + b"Content-Length: 100\r\n\r\n{")
        for _ in range(20):
            time.sleep(0.1)
            with contextlib.suppress(OSError):
                sock.sendall(b" ")
            if select.select([sock], [], [], 0)[0]:
                break
        status, response = answer(sock)
        elapsed = time.monotonic() - started
    assert status == 408 and b"request body not received in time" in response and 0.7 < elapsed < 2.5
    assert stub.received == []


# -- idle and concurrent connections --------------------------------------------------------


def test_an_idle_connection_closes_after_the_keep_alive_timeout(stub: StubServer) -> None:
    with running_proxy(config_for(stub.url, keep_alive_timeout=0.5)) as proxy, connection(proxy.url) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        assert closed_by_peer(sock, wait=2)


def test_connections_beyond_the_limit_get_a_503(stub: StubServer) -> None:
    with running_proxy(config_for(stub.url, max_client_connections=3)) as proxy:
        with connection(proxy.url), connection(proxy.url), connection(proxy.url) as third:
            third.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n")
            status, _ = answer(third)
            assert status == 503
        time.sleep(0.2)  # the server sees the others close
        with connection(proxy.url) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n")
            assert answer(sock)[0] == 200


def test_the_limits_have_safe_defaults_and_reach_uvicorn() -> None:
    config = ServeConfig.from_mapping({"prefill": ["http://p:1/v1"], "decode": ["http://d:1/v1"]})
    assert (config.header_timeout, config.body_timeout, config.keep_alive_timeout) == (10.0, 120.0, 5.0)
    assert (config.max_header_size, config.max_client_connections) == (65536, 1024)
    server = server_config(config, object(), log_config=None)  # no logging set up for the whole test session
    assert server.http is HttpToolsConnection and server.timeout_keep_alive == 5.0
    assert server.limit_concurrency == 1024 and server.h11_max_incomplete_event_size == 65536
    assert (server.header_timeout, server.body_timeout, server.max_header_size) == (10.0, 120.0, 65536)
    unlimited = server_config(
        ServeConfig.from_mapping({**config.to_mapping(), "max_client_connections": 0}), None, log_config=None
    )
    assert unlimited.limit_concurrency is None


@pytest.mark.parametrize(
    ("setting", "value"),
    [("header_timeout", 0), ("body_timeout", -1), ("keep_alive_timeout", float("nan")), ("max_header_size", 10)],
)
def test_bad_limits_are_one_clear_error(setting: str, value: float) -> None:
    from pdclient import PDConfigError

    with pytest.raises(PDConfigError, match=setting):
        ServeConfig.from_mapping({"prefill": ["http://p:1/v1"], "decode": ["http://d:1/v1"], setting: value})
