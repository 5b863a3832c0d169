"""Helpers for the fleet tests on loopback stubs: waiting, other clients' load, stubs on
several loopback addresses behind one name (the resolver hook), and a member that never
finishes an answer (``Dripping``)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

from tests.stubserver import StubServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def hold(stub: StubServer, n: int) -> list[threading.Thread]:
    """``n`` streams to ``stub`` from other clients (another process, as far as the pool knows)."""

    def stream() -> None:
        with httpx.Client(timeout=30) as client:
            client.post(stub.url + "/chat/completions", json=CHAT).read()

    threads = [threading.Thread(target=stream) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def start_on(hosts: list[str], **kwargs: object) -> list[StubServer]:
    """Stubs on several loopback addresses, one port (as pods behind a headless Service)."""
    for _ in range(5):
        first = StubServer(host=hosts[0], **kwargs).start()  # type: ignore[arg-type]
        try:
            rest = [StubServer(host=h, port=first.port, **kwargs).start() for h in hosts[1:]]  # type: ignore[arg-type]
        except OSError:
            first.stop()
            continue
        return [first, *rest]
    raise RuntimeError("no common free port")


class Zone:
    """A resolver hook: what the name resolves to now (tests change it)."""

    def __init__(self, addresses: list[str], name: str = "vllm-decode.test") -> None:
        self.addresses = addresses
        self.name = name

    def __call__(self, host: str, port: int) -> list[str]:
        if host != self.name:
            raise OSError(f"unknown host {host}")
        return list(self.addresses)


class Dripping:
    """A member that is up but never finishes an answer: every GET gets 200 and its headers
    at once, then its body one byte every ``seconds`` (a wedged server, or one starved of CPU).

    No single read waits long, so only a deadline on the whole answer tells it apart from
    a slow but healthy server. ``hits`` counts the requests per path.
    """

    def __init__(self, *, seconds: float = 0.1, size: int = 10_000, host: str = "127.0.0.1") -> None:
        self.seconds = seconds
        self.size = size
        self.hits: dict[str, int] = {}
        self._host = host
        self._stopping = threading.Event()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                owner.hits[path] = owner.hits.get(path, 0) + 1
                self.send_response(200)
                self.send_header("content-type", "text/plain")
                self.send_header("content-length", str(owner.size))
                self.end_headers()
                for _ in range(owner.size):
                    if owner._stopping.wait(owner.seconds):
                        break
                    try:
                        self.wfile.write(b"#")
                        self.wfile.flush()
                    except OSError:  # the client gave up
                        break
                self.close_connection = True

        self._httpd = ThreadingHTTPServer((host, 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="dripping-stub", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self._httpd.server_port}/v1"

    def __enter__(self) -> Dripping:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stopping.set()
        self._httpd.shutdown()
        self._httpd.server_close()
