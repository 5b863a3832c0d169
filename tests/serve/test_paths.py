"""The path a caller sends is read once, as the servers' router reads it (decoded, dot
segments resolved, repeated slashes merged): the handoff chooses its route by the very
path the servers get, and nothing outside /v1 is ever forwarded."""

from __future__ import annotations

import http.client
import json
from typing import Any

import pytest

from pdclient.serve._paths import upstream_path
from tests.stubserver import StubServer

from .conftest import MESSAGES, RunningProxy, config_for, running_proxy

CHAT = {"model": "m", "messages": MESSAGES}


def send(proxy: RunningProxy, method: str, target: str, body: Any = None) -> tuple[int, dict[str, Any]]:
    """One request with ``target`` sent as written (http.client, unlike httpx, resolves no dot segments)."""
    connection = http.client.HTTPConnection(proxy.url.removeprefix("http://"), timeout=10)
    try:
        content = None if body is None else json.dumps(body).encode()
        headers = {} if content is None else {"content-type": "application/json"}
        connection.request(method, target, body=content, headers=headers)
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"/v1/chat/completions", "/v1/chat/completions"),
        (b"/v1/chat%2Fcompletions", "/v1/chat/completions"),
        (b"/v1//chat/./completions/", "/v1/chat/completions/"),
        (b"/v1/models/../chat/completions", "/v1/chat/completions"),
        (b"/v1/models/org%2Fname", "/v1/models/org/name"),
        (b"/v1/files/a%20b%3Fc%23d%25e", "/v1/files/a%20b%3Fc%23d%25e"),
        (b"/v1/x%0aY", "/v1/x%0AY"),
        (b"/v1/%252e%252e/x", "/v1/%252e%252e/x"),  # decoded once, as the servers decode it
        (b"/v1/", "/v1/"),
        (b"/v1/..", None),
        (b"/v1/../reset_prefix_cache", None),
        (b"/v1/%2e%2e/x", None),
        (b"/v1/%2E%2E%2Fsleep", None),
        (b"/v1/chat/../../x", None),
        (b"/v1x/models", None),
    ],
)
def test_upstream_path(raw: bytes, expected: str | None) -> None:
    assert upstream_path(raw) == expected


@pytest.mark.parametrize(
    "target",
    [
        "/v1/../reset_prefix_cache",
        "/v1/../sleep?level=1",
        "/v1/%2e%2e/x",
        "/v1/%2E%2E/reset_prefix_cache",
        "/v1/..%2f..%2freset_prefix_cache",
        "/v1/chat/../../reset_prefix_cache",
        "/v1//..//..//sleep?level=1",
    ],
)
@pytest.mark.parametrize("method", ["GET", "POST"])
def test_a_path_leaving_v1_is_the_proxys_404_never_forwarded(stub: StubServer, method: str, target: str) -> None:
    # With an upstream key too: a caller must never reach the servers' other routes with it.
    with running_proxy(config_for(stub.url, upstream_api_key="server-key")) as proxy:
        status, body = send(proxy, method, target, {} if method == "POST" else None)
    assert status == 404 and "only paths under /v1/ are proxied" in body["error"]["message"]
    assert stub.received == []


def test_an_encoded_chat_path_takes_the_handoff(proxy: RunningProxy, stub: StubServer) -> None:
    """vLLM routes /v1/chat%2Fcompletions as chat; the proxy does too, so it is a handoff."""
    for target in (
        "/v1/chat%2Fcompletions",
        "/v1/chat%2fcompletions",
        "/v1//chat/./completions",
        "/v1/x/../chat/completions",
    ):
        status, body = send(proxy, "POST", target, CHAT)
        assert status == 200 and body["choices"][0]["message"]["content"], target
    assert len(stub.legs("prefill")) == len(stub.legs("decode")) == 4
    assert {r.path for r in stub.received} == {"/v1/chat/completions"}


@pytest.mark.parametrize("target", ["/v1/chat%2Fcompletions", "/v1/./chat//completions", "/v1/x/%2e%2e/completions"])
def test_an_encoded_handoff_path_with_the_callers_kv_transfer_params_is_refused(
    proxy: RunningProxy, stub: StubServer, target: str
) -> None:
    """Never passed through with the caller's kv_transfer_params: the handoff sees the path."""
    kv = {"remote_host": "10.0.0.9", "remote_port": 5600, "remote_block_ids": [1, 2], "do_remote_prefill": True}
    body = (
        {**CHAT, "kv_transfer_params": kv}
        if "chat" in target
        else {"model": "m", "prompt": "x", "kv_transfer_params": kv}
    )
    status, answer = send(proxy, "POST", target, body)
    assert status == 400 and "kv_transfer_params" in answer["error"]["message"]
    assert stub.received == []
