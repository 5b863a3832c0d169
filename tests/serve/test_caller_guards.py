"""The proxy refuses what its transport refuses: the app in process, its legs answered by a mock.

A caller of ``pdclient serve`` can give a server no ``kv_transfer_params``, on any path
and in any encoding, nor loosen the operator's settings with its own per-call options.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from pdclient.serve import create_app
from tests.fake_vllm import DECODE, PREFILL, VLLMAnswers
from tests.serve.conftest import config_for  # skips the module without pdclient[serve]

MESSAGES = [{"role": "user", "content": "Say hello."}]
FOREIGN = {"do_remote_prefill": True, "remote_host": "10.0.0.66", "remote_port": 5600, "remote_block_ids": [1]}


class Legs:
    """The servers behind the proxy: a prefill and a decode answering as vLLM does; records each leg."""

    def __init__(self) -> None:
        self.answers = VLLMAnswers()
        self.sent: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append(request)
        path = request.url.path
        if not path.endswith("/chat/completions"):
            return httpx.Response(200, json={"ok": True})
        body = json.loads(request.content)
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return httpx.Response(200, json=self.answers.prefill(path, body))
        return httpx.Response(200, json=self.answers.decode(path, body))


@pytest.fixture
async def proxy() -> AsyncIterator[tuple[httpx.AsyncClient, Legs]]:
    legs = Legs()
    app = create_app(config_for(PREFILL, DECODE), leg_transport=httpx.MockTransport(legs))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        yield client, legs


def refused(response: httpx.Response, fragment: str) -> None:
    assert response.status_code == 400, response.text
    assert fragment in response.json()["error"]["message"]


async def test_a_caller_cannot_send_kv_transfer_params_on_any_route(proxy: tuple[httpx.AsyncClient, Legs]) -> None:
    client, legs = proxy
    escaped = b'{"model":"m","messages":[],"kv\\u005ftransfer_params":{"remote_host":"10.0.0.66"}}'
    cases: list[tuple[str, dict[str, Any]]] = [
        ("/v1/chat/completions", {"content": escaped, "headers": {"content-type": "application/json"}}),
        ("/v1/responses", {"json": {"model": "m", "input": "hi", "kv_transfer_params": FOREIGN}}),
        ("/v1/embeddings", {"content": json.dumps({"input": "x", "kv_transfer_params": FOREIGN}).encode()}),
        ("/v1/completions", {"json": {"model": "m", "prompt": "x", "vllm_xargs": {"kv_transfer_params": [1]}}}),
        (
            "/v1/audio/transcriptions",
            {"data": {"model": "w", "vllm_xargs": '{"kv\\u005ftransfer_params": []}'}, "files": {"file": b"RIFF"}},
        ),
    ]
    for path, request in cases:
        response = await client.post(path, **request)
        refused(response, "kv_transfer_params" if "transcriptions" not in path else "vllm_xargs")
    assert legs.sent == []


async def test_a_caller_cannot_loosen_the_operators_settings(proxy: tuple[httpx.AsyncClient, Legs]) -> None:
    client, legs = proxy
    loosening = [{"max_decode_migrations": 9}, {"remote_prefill": "never"}]
    for options in loosening:
        response = await client.post(
            "/v1/chat/completions", json={"model": "m", "messages": MESSAGES, "pdclient": options}
        )
        refused(response, "allow_call_overrides is off")
    assert legs.sent == []
    narrowing = {
        "model": "m",
        "messages": MESSAGES,
        "pdclient": {"max_decode_migrations": 0, "remote_prefill": "always"},
    }
    answered = await client.post("/v1/chat/completions", json=narrowing)
    assert answered.status_code == 200 and len(legs.sent) == 2
