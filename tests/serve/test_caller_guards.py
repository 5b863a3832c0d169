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


class Redirecting(Legs):
    """Servers that answer a path with a trailing slash as vLLM's router does: a 307 to the
    path without it, as an absolute URL naming the server (from the Host it was sent)."""

    def __init__(self, prefill_location: str | None = None) -> None:
        super().__init__()
        self.prefill_location = prefill_location

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if self.prefill_location and b"do_remote_decode" in request.content:
            self.sent.append(request)
            return httpx.Response(307, headers={"location": self.prefill_location})
        if request.url.path.endswith("/"):
            self.sent.append(request)
            location = f"{request.url.scheme}://{request.url.netloc.decode()}{request.url.path.rstrip('/')}"
            return httpx.Response(307, headers={"location": location})
        return super().__call__(request)


@pytest.mark.parametrize("trace_headers", [False, True])
async def test_a_servers_redirect_does_not_name_it(trace_headers: bool) -> None:
    legs = Redirecting()
    config = config_for(PREFILL, DECODE, trace_headers=trace_headers)
    app = create_app(config, leg_transport=httpx.MockTransport(legs))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        response = await client.get("/v1/models/?limit=2")
    assert response.status_code == 307 and len(legs.sent) == 1
    assert response.headers["location"] == "/v1/models"  # the proxy's own path, relative
    assert "decode.test" not in str(response.headers.raw)


async def test_a_prefill_redirect_is_a_failed_prefill_leg_that_names_no_server() -> None:
    legs = Redirecting(prefill_location="http://prefill.test:8100/v1/chat/completions")
    app = create_app(config_for(PREFILL, DECODE, on_prefill_failure="fail"), leg_transport=httpx.MockTransport(legs))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        response = await client.post("/v1/chat/completions", json={"model": "m", "messages": MESSAGES})
    assert response.status_code == 502 and response.headers["x-pd-failed-leg"] == "prefill"
    assert "location" not in response.headers and "prefill.test" not in response.text
    assert "answered a redirect, not a prefill" in response.json()["error"]["message"]
    assert len(legs.sent) == 1  # not retried, no decode


def test_a_location_becomes_the_proxys_own_path_or_is_dropped() -> None:
    from pdclient.serve._paths import base_paths, own_location

    bases = base_paths(["http://d:8200/v1", "http://user:pw@p:8100/api/v1/", "http://root:8000"])
    assert bases == (b"/api/v1", b"/v1", b"")
    assert own_location(b"http://d:8200/v1/models?x=1", bases) == b"/v1/models?x=1"
    assert own_location(b"http://p:8100/api/v1/files", bases) == b"/v1/files"
    assert own_location(b"/models", bases) == b"/v1/models"  # the root base: the server's /models is /v1/models
    assert own_location(b"models", bases) == b"models"  # relative to the request's path: names nothing
    assert own_location(b"http://d:8200/v1/models", (b"/v1",)) == b"/v1/models"
    assert own_location(b"http://elsewhere/login", (b"/v1",)) is None
    assert own_location(b"//d:8200/metrics", (b"/v1",)) is None
