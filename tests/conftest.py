"""Shared fixtures: fake vLLM prefill/decode responses for respx, sync/async twins, and
the one real local pair that tests/e2e, tests/frameworks and tests/test_examples.py share."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdclient._endpoints import DECODE_ENV, PREFILL_ENV
from pdclient.local import PDServers, pair_from_env_or_local

PREFILL = "http://prefill.test:8100/v1"
DECODE = "http://decode.test:8200/v1"
NIXL_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [3, 4],
    "remote_engine_id": "engine-p",
    "remote_request_id": "req-p",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}


def ids_for(text: str) -> list[int]:
    """Deterministic fake token ids of a prompt, distinct for distinct prompts."""
    return [ord(c) for c in text]


def last_user_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    return str(body["prompt"])


def prefill_json(body: dict[str, Any], *, kv_params: dict[str, Any] | None = NIXL_PARAMS) -> dict[str, Any]:
    ids = ids_for(last_user_text(body))
    base: dict[str, Any] = {"id": "cmpl-p", "created": 1, "model": body.get("model", "m"), "usage": None}
    if "messages" in body:
        message = {"role": "assistant", "content": "x"}
        choice = {"index": 0, "message": message, "finish_reason": "length"}
        return {
            **base,
            "object": "chat.completion",
            "choices": [choice],
            "prompt_token_ids": ids,
            "kv_transfer_params": kv_params,
        }
    choice = {"index": 0, "text": "x", "finish_reason": "length", "prompt_token_ids": ids}
    return {**base, "object": "text_completion", "choices": [choice], "kv_transfer_params": kv_params}


def chat_json(content: str, model: str = "m") -> dict[str, Any]:
    return {
        "id": "cmpl-d",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
    }


def chat_chunk(content: str, model: str = "m") -> bytes:
    chunk = {
        "id": "cmpl-d",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def sse(*pieces: str) -> bytes:
    return b"".join(chat_chunk(p) for p in pieces) + b"data: [DONE]\n\n"


def decode_answer(request: httpx.Request) -> httpx.Response:
    """A decode server that answers with the text it was given, streamed or not."""
    body = json.loads(request.content)
    answer = f"echo:{last_user_text(body)}"
    if body.get("stream"):
        return httpx.Response(200, content=sse(answer[:3], answer[3:]), headers={"content-type": "text/event-stream"})
    return httpx.Response(200, json=chat_json(answer))


def prefill_answer(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json=prefill_json(json.loads(request.content)))


@pytest.fixture
def pd_routes() -> Iterator[Any]:
    """respx with named ``prefill`` and ``decode`` routes answering like vLLM."""
    import respx

    with respx.mock(assert_all_called=False) as router:
        router.post(f"{PREFILL}/chat/completions", name="prefill").mock(side_effect=prefill_answer)
        router.post(f"{DECODE}/chat/completions", name="decode").mock(side_effect=decode_answer)
        yield router


@pytest.fixture(params=["sync", "async"])
def mode(request: pytest.FixtureRequest) -> str:
    """Run a test once with PDChatClient and once with AsyncPDChatClient."""
    return str(request.param)


@pytest.fixture(scope="session")
def pd() -> Iterator[PDServers]:
    """The real servers, started once per session (~7 GB, ~30 s) by their first user.

    ``PDCLIENT_E2E_PAIR=prefill_url,decode_url`` attaches to a running pair instead (no
    start, no stop; ``pd.local`` is None): for iterating on the real-pair tests without a
    server restart per run, or for running them against another deployment serving the
    same model. A variable of its own, not ``PDCLIENT_PREFILL_BASE_URL`` /
    ``PDCLIENT_DECODE_BASE_URL``: those configure pdclient's clients, and the client
    tests set and clear them; exported in a shell for other work, they must not
    silently move the real-pair tier to other servers.
    """
    environ: dict[str, str] = {}
    attach = os.environ.get("PDCLIENT_E2E_PAIR")
    if attach:
        prefill_url, decode_url = attach.split(",")
        environ = {PREFILL_ENV: prefill_url, DECODE_ENV: decode_url}
    # Tool calling on, so the framework and example tests can share this one pair.
    with pair_from_env_or_local(
        environ=environ, extra_server_args=("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    ) as servers:
        yield servers
