"""Decode migration through ``pdclient serve``: what a plain HTTP client receives when a decode dies.

One prefill stub and two decode stubs; every call's first decode (no ``-m`` in its request
id) is cut after a number of SSE events. The caller is plain httpx, as curl or another
language's SDK would be: it gets one JSON body for a non-streamed call, and an event
stream ended once for a streamed call cut after its answer. The proxy runs with
``--migrate-non-streamed``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.stubserver import Fault, Received, StubServer

from .conftest import MESSAGES, RunningProxy, config_for, running_proxy

WORDS = tuple(f" w{i}" for i in range(12))


def first_decodes(fault: Fault) -> Any:
    def hook(received: Received) -> Fault | None:
        if received.leg == "decode" and "-m" not in received.headers.get("x-request-id", ""):
            return fault
        return None

    return hook


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[StubServer, StubServer, StubServer]]:
    with StubServer(words=WORDS) as prefill, StubServer(words=WORDS) as d1, StubServer(words=WORDS) as d2:
        yield prefill, d1, d2


@pytest.fixture
def proxy(servers: tuple[StubServer, StubServer, StubServer]) -> Iterator[RunningProxy]:
    prefill, d1, d2 = servers
    for server in servers:
        server.clear()
        server.fault_hook = None
    with running_proxy(config_for(prefill.url, [d1.url, d2.url], migrate_non_streamed=True)) as running:
        yield running


def decodes(*servers: StubServer) -> list[Received]:
    return [r for s in servers for r in s.legs("decode")]


async def test_a_non_streamed_call_whose_decode_dies_gets_one_json_body(
    proxy: RunningProxy, servers: tuple[StubServer, StubServer, StubServer]
) -> None:
    _, d1, d2 = servers
    for server in (d1, d2):
        server.fault_hook = first_decodes(Fault(drop_after_events=5, reset=True))
    body = {"model": "m", "messages": MESSAGES, "max_tokens": 40}
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(proxy.base_url + "/chat/completions", json=body)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    answer = response.json()
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["content"] == "".join(WORDS)
    assert answer["choices"][0]["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == len(WORDS)
    assert b'token_ids":[' not in response.content
    assert [r.headers["x-request-id"].endswith("-m1") for r in decodes(d1, d2)].count(True) == 1


async def test_a_stream_cut_after_its_finish_ends_once(
    proxy: RunningProxy, servers: tuple[StubServer, StubServer, StubServer]
) -> None:
    _, d1, d2 = servers
    for server in (d1, d2):
        server.fault_hook = first_decodes(Fault(drop_after_events=1 + len(WORDS) + 1))  # role, words, finish
    body = {"model": "m", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=10) as http:
        response = await http.post(proxy.base_url + "/chat/completions", json=body)
    events = [e.removeprefix(b"data: ") for e in response.content.split(b"\n\n") if e]
    assert events[-1] == b"[DONE]" and response.content.count(b"[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == "".join(WORDS), "the answer once, nothing after its end"
    assert [c["usage"]["completion_tokens"] for c in chunks if c.get("usage")] == [len(WORDS) + 1]
    assert len(decodes(d1, d2)) == 1
