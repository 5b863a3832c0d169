"""The loopback stub of a vLLM P/D pair works, with pdclient and at the HTTP level."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdclient import AsyncPDChatClient, PDChatClient, PDTrace
from tests.stubserver import Fault, StubServer

PROMPT_TOKENS = 300
MESSAGES: Any = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def server() -> Iterator[StubServer]:
    with StubServer(prompt_tokens=PROMPT_TOKENS) as stub:
        yield stub


@pytest.fixture
def stub(server: StubServer) -> StubServer:
    server.clear()
    return server


def assert_one_handoff(stub: StubServer, path: str = "/v1/chat/completions") -> None:
    prefill, decode = stub.legs("prefill"), stub.legs("decode")
    assert len(prefill) == len(decode) == 1
    assert prefill[0].path == decode[0].path == path
    assert prefill[0].body["stream"] is False and prefill[0].body["max_tokens"] == 1
    assert prefill[0].headers["x-request-id"] == decode[0].headers["x-request-id"]
    assert decode[0].body["kv_transfer_params"]["remote_engine_id"] == "stub-prefill-engine-0"
    assert decode[0].forwarded_ids == PROMPT_TOKENS


def test_sync_stream(stub: StubServer) -> None:
    traces: list[PDTrace] = []
    client = PDChatClient(prefill_base_url=stub.url, decode_base_url=stub.url, api_key="-", on_trace=traces.append)
    with client:
        stream = client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == "Hello from the decode stub"
    assert_one_handoff(stub)
    assert stub.legs("decode")[0].ids_match is True
    assert traces[0].forwarded_tokens == PROMPT_TOKENS and traces[0].fallback is None


def test_sync_json_and_completions(stub: StubServer) -> None:
    with PDChatClient(prefill_base_url=stub.url, decode_base_url=stub.url, api_key="-") as client:
        chat = client.chat.completions.create(model="m", messages=MESSAGES)
        assert chat.usage is not None and chat.usage.prompt_tokens == PROMPT_TOKENS
        assert_one_handoff(stub)
        stub.clear()
        completion = client.completions.create(model="m", prompt="Once upon a time", max_tokens=5)
        assert completion.choices[0].text == "Hello from the decode stub"
        assert_one_handoff(stub, "/v1/completions")
        assert isinstance(stub.legs("decode")[0].body["prompt"], list)
        assert [m.id for m in client.models.list()] == ["stub-model"]


async def test_async_stream(stub: StubServer) -> None:
    traces: list[PDTrace] = []
    client = AsyncPDChatClient(prefill_base_url=stub.url, decode_base_url=stub.url, api_key="-", on_trace=traces.append)
    async with client:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
    assert text == "Hello from the decode stub"
    assert_one_handoff(stub)
    assert stub.legs("decode")[0].ids_match is True
    assert traces[0].forwarded_tokens == PROMPT_TOKENS


async def test_async_json(stub: StubServer) -> None:
    async with AsyncPDChatClient(prefill_base_url=stub.url, decode_base_url=stub.url, api_key="-") as client:
        chat = await client.chat.completions.create(model="m", messages=MESSAGES)
    assert chat.choices[0].message.content == "Hello from the decode stub"
    assert_one_handoff(stub)


def test_keep_alive(stub: StubServer) -> None:
    with httpx.Client(base_url=stub.url) as http:
        for _ in range(3):
            assert http.get("/models").status_code == 200
    assert len({r.client_port for r in stub.received}) == 1


def test_ids_match_tells_a_foreign_prompt(stub: StubServer) -> None:
    with httpx.Client(base_url=stub.url) as http:
        kv = {"do_remote_decode": True}
        prefill = http.post("/chat/completions", json={"model": "m", "messages": MESSAGES, "kv_transfer_params": kv})
        ids = prefill.json()["prompt_token_ids"]
        other = {"model": "m", "messages": [{"role": "user", "content": "Another."}]}
        http.post("/chat/completions", json={**other, "kv_transfer_params": {"prompt_token_ids": ids}})
    assert stub.legs("decode")[0].ids_match is False


def test_faults(stub: StubServer) -> None:
    with httpx.Client(base_url=stub.url) as http:
        stub.inject(Fault(status=503), leg="other")
        assert http.get("/models").status_code == 503
        assert http.get("/models").status_code == 200  # times=1: used up

        stub.inject(Fault(drop=True))
        with pytest.raises(httpx.RemoteProtocolError):
            http.get("/models")

        stub.inject(Fault(delay=0.2))
        started = time.perf_counter()
        http.get("/models")
        assert time.perf_counter() - started >= 0.2

        stub.inject(Fault(drop_after_events=2), leg="decode")
        body = {"model": "m", "messages": MESSAGES, "stream": True}
        with pytest.raises(httpx.RemoteProtocolError), http.stream("POST", "/chat/completions", json=body) as response:
            assert response.status_code == 200
            for _ in response.iter_lines():
                pass

    stub.fault_hook = lambda received: Fault(status=429) if received.leg == "prefill" else None
    try:
        prefill = {"messages": MESSAGES, "kv_transfer_params": {"do_remote_decode": True}}
        assert httpx.post(f"{stub.url}/chat/completions", json=prefill).status_code == 429
    finally:
        stub.fault_hook = None


def test_tokenize_and_render_answer_as_vllm_after_their_cost() -> None:
    """What vllm-router asks both servers before each call: the prompt's ids, after the
    template and tokenizer's time (here 10 ms per 1k tokens: 3 ms for 300 tokens)."""
    with StubServer(prompt_tokens=PROMPT_TOKENS, preprocess_ms_per_1k_tokens=10) as stub:
        root = stub.url.removesuffix("/v1")
        body = {"model": "m", "messages": MESSAGES}
        started = time.perf_counter()
        tokenized = httpx.post(root + "/tokenize", json=body).json()
        took = time.perf_counter() - started
        rendered = httpx.post(stub.url + "/chat/completions/render", json=body).json()
        counts = httpx.get(root + "/stub/counts").json()
    assert tokenized["count"] == PROMPT_TOKENS == len(tokenized["tokens"]) and took >= 0.003
    conversation, (prompt,) = rendered
    assert conversation == MESSAGES and prompt["prompt_token_ids"] == tokenized["tokens"]
    assert counts == {"/tokenize": 1, "/v1/chat/completions/render": 1}
