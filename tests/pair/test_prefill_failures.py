"""A prefill server that is down, hangs or dies mid-request: a clear error or the fallback, never a hang.

The prefill here is a dead port or a socket that misbehaves; the decode server is the
real one. (A real prefill server killed mid-run is in test_plain_server.py.)
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from pdclient import PDChatClient, PDTrace, RetrySettings
from pdclient.local import PDServers
from pdclient.local._server import free_port

from .helpers import GREEDY, chat_text, user

QUESTION = "What is the boiling point of water at sea level?"


class _BadPrefill:
    """Accepts connections on loopback and then either never answers or drops the request."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.held: list[socket.socket] = []
        self.requests = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.requests += 1
            if self.mode == "hang":
                self.held.append(conn)  # read nothing, answer nothing
            else:  # "drop": read the request, then die without a response, like a killed server
                conn.recv(65536)
                conn.close()

    def close(self) -> None:
        self.sock.close()
        for conn in self.held:
            conn.close()


@pytest.fixture(params=["down", "hang", "drop"])
def bad_prefill(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "down":
        yield f"http://127.0.0.1:{free_port()}/v1"  # nothing listens there
        return
    server = _BadPrefill(request.param)
    yield server.url
    server.close()


def _client(pd: PDServers, prefill_url: str, traces: list[PDTrace], policy: str) -> PDChatClient:
    # timeout bounds each decode read (leave room for a loaded 2-core machine and the VM's
    # stalls); prefill_timeout bounds the prefill phase alone, so a hung prefill costs 15 s,
    # not the read timeout's 60; max_retries=0 keeps openai from repeating the whole call.
    return PDChatClient(
        prefill_base_url=prefill_url,
        decode_base_url=pd.decode_url,
        api_key="EMPTY",
        on_trace=traces.append,
        on_prefill_failure=policy,  # type: ignore[arg-type]
        timeout=60,
        retries=RetrySettings(prefill_timeout=15),
        max_retries=0,
    )


def test_prefill_failure_falls_back_to_decode(pd: PDServers, plain: openai.OpenAI, bad_prefill: str) -> None:
    traces: list[PDTrace] = []
    started = time.monotonic()
    with _client(pd, bad_prefill, traces, "decode") as client:
        answer = client.chat.completions.create(model=pd.model, messages=user(QUESTION), **GREEDY)
    elapsed = time.monotonic() - started
    assert answer.choices[0].message.content == chat_text(plain, pd.model, QUESTION)
    assert traces[-1].fallback is not None and traces[-1].fallback.startswith("prefill failed")
    assert traces[-1].forwarded_tokens == 0
    assert elapsed < 180, f"fallback took {elapsed:.0f} s"


def test_prefill_failure_is_a_clear_error(pd: PDServers, bad_prefill: str) -> None:
    traces: list[PDTrace] = []
    started = time.monotonic()
    with (
        _client(pd, bad_prefill, traces, "fail") as client,
        pytest.raises(openai.APIStatusError) as info,
    ):
        client.chat.completions.create(model=pd.model, messages=user(QUESTION), **GREEDY)
    elapsed = time.monotonic() - started
    assert "prefill" in info.value.message
    assert info.value.response.headers.get("x-pd-failed-leg") == "prefill"
    assert elapsed < 90, f"the error took {elapsed:.0f} s"
