"""The guard in front of vLLM's real app and routes, in-process: what a caller can reach through them.

The FastAPI app is vLLM's own, built by its ``build_app`` from its own argument parser
(``--enable-scale-out``, so ``/inference/v1/generate`` exists), with the guard installed
as ``register()`` installs it. Only the serving objects behind the routes are stand-ins:
they record the request the route parsed. The controls without the secret show that each
payload really reaches the route (the attack is real). vLLM 0.32 only: older versions
build their app elsewhere and have no generate route.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from pdclient_server_patch import _guard
from pdclient_server_patch._signing import SIGNATURE_HEADER
from test_signing import client_signing

SECRET = "route-secret"
CHAT = "/v1/chat/completions"
GENERATE = "/inference/v1/generate"
KV = {"do_remote_prefill": True, "remote_host": "attacker.example", "remote_port": 5600, "prompt_token_ids": [1, 2]}
JSON = {"content-type": "application/json"}


class Handlers:
    """Stand-ins for vLLM's serving objects: record what the real route handed them."""

    def __init__(self) -> None:
        self.chat: list[Any] = []
        self.generate: list[Any] = []
        self.responses: list[Any] = []
        self.messages: list[Any] = []

    async def create_chat_completion(self, request: Any, raw_request: Any) -> AsyncIterator[str]:
        self.chat.append(request)
        return self._done()

    async def serve_tokens(self, request: Any, raw_request: Any) -> AsyncIterator[str]:
        self.generate.append(request)
        return self._done()

    async def create_responses(self, request: Any, raw_request: Any) -> AsyncIterator[Any]:
        self.responses.append(request)
        return self._nothing()

    async def create_messages(self, request: Any, raw_request: Any) -> AsyncIterator[str]:
        self.messages.append(request)
        return self._done()

    @staticmethod
    async def _nothing() -> AsyncIterator[Any]:
        return
        yield

    @staticmethod
    async def _done() -> AsyncIterator[str]:
        yield "data: [DONE]\n\n"


@pytest.fixture
def vllm_app(vllm_version: str) -> Iterator[Any]:
    """``make(secret, *flags)`` -> (vLLM's app, its handlers); the guard installed when secret is set."""
    if not vllm_version.startswith("0.32"):
        pytest.skip("vLLM's real app is built in-process on 0.32 only")
    from fastapi import FastAPI
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    original = FastAPI.build_middleware_stack

    def make(secret: str | None, *flags: str) -> tuple[Any, Handlers]:
        FastAPI.build_middleware_stack = original  # type: ignore[method-assign]
        if secret is not None:
            _guard.install(secret)  # as register() does with PDCLIENT_REUSE_SECRET set
        args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--enable-scale-out", *flags])
        root, level = logging.getLogger(), logging.getLogger().level
        app = build_app(args, ("generate",), None)
        # build_app imports model_hosting_container_standards (SageMaker), which sets the
        # root logger to ERROR: later tests reading the plugin's warnings would see none.
        root.setLevel(level)
        handlers = Handlers()
        app.state.openai_serving_chat = handlers
        app.state.serving_tokens = handlers
        app.state.openai_serving_responses = handlers
        app.state.anthropic_serving_messages = handlers
        return app, handlers

    try:
        yield make
    finally:
        FastAPI.build_middleware_stack = original  # type: ignore[method-assign]


def send(app: Any, requests: list[tuple[str, bytes, dict[str, str]]]) -> list[httpx.Response]:
    async def go() -> list[httpx.Response]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://vllm") as client:
            return [
                await client.post(path, content=body, headers={**JSON, **headers}) for path, body, headers in requests
            ]

    return asyncio.run(go())


def chat_body(kv: Any = KV, **extra: Any) -> dict[str, Any]:
    return {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "kv_transfer_params": kv, **extra}


GENERATE_BODY = {"token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "extra_args": {"kv_transfer_params": KV}}}


def signed(path: str, body: bytes, **kwargs: Any) -> dict[str, str]:
    """Headers signed by pdclient's own signer."""
    return {SIGNATURE_HEADER: client_signing().signature(SECRET, "POST", path, body, **kwargs)}


def test_control_without_guard_the_attacks_reach_the_routes(vllm_app: Any) -> None:
    app, seen = vllm_app(None)
    utf16 = json.dumps(chat_body()).encode("utf-16-le")
    generate = json.dumps(GENERATE_BODY).encode()
    assert [r.status_code for r in send(app, [(CHAT, utf16, {}), (GENERATE, generate, {})])] == [200, 200]
    assert seen.chat[0].kv_transfer_params["remote_host"] == "attacker.example"
    assert seen.generate[0].sampling_params.extra_args["kv_transfer_params"]["remote_host"] == "attacker.example"


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_unsigned_chat_is_403_in_every_json_encoding(vllm_app: Any, encoding: str) -> None:
    app, seen = vllm_app(SECRET)
    (response,) = send(app, [(CHAT, json.dumps(chat_body()).encode(encoding), {})])
    assert response.status_code == 403, response.text
    assert response.json()["error"]["code"] == 403 and seen.chat == []


def test_unsigned_generate_extra_args_is_403_signed_passes(vllm_app: Any) -> None:
    app, seen = vllm_app(SECRET)
    body = json.dumps(GENERATE_BODY).encode()
    unsigned, ok = send(app, [(GENERATE, body, {}), (GENERATE, body, signed(GENERATE, body))])
    assert unsigned.status_code == 403 and ok.status_code == 200, (unsigned.text, ok.text)
    (request,) = seen.generate
    assert request.sampling_params.extra_args["kv_transfer_params"] == KV


def test_signed_by_pdclient_passes_once_and_only_as_signed(vllm_app: Any) -> None:
    app, seen = vllm_app(SECRET)
    body = json.dumps(chat_body(max_tokens=4)).encode()
    headers = signed(CHAT, body)
    other_messages = json.dumps(chat_body(max_tokens=4, messages=[{"role": "user", "content": "Else"}])).encode()
    other_max_tokens = json.dumps(chat_body(max_tokens=4000)).encode()
    expired = signed(CHAT, body, ttl=60, now=time.time() - 61)
    responses = send(
        app,
        [
            (CHAT, body, headers),  # accepted
            (CHAT, body, headers),  # replayed
            (CHAT, other_messages, signed(CHAT, body)),
            (CHAT, other_max_tokens, signed(CHAT, body)),
            (CHAT, body, expired),
            ("/v1/completions", body, signed(CHAT, body)),
        ],
    )
    assert [r.status_code for r in responses] == [200, 403, 403, 403, 403, 403], [r.text for r in responses]
    assert "nonce already used" in responses[1].json()["error"]["message"]
    assert "expired" in responses[4].json()["error"]["message"]
    (request,) = seen.chat
    assert request.kv_transfer_params == KV and request.max_tokens == 4


def test_lone_surrogate_reaches_the_route_or_is_4xx_never_500(vllm_app: Any) -> None:
    app, seen = vllm_app(SECRET)
    body = json.dumps(chat_body(messages=[{"role": "user", "content": "\ud800 lone"}])).encode()
    ok, unsigned = send(app, [(CHAT, body, signed(CHAT, body)), (CHAT, body, {})])
    assert ok.status_code == 200 and unsigned.status_code == 403
    assert seen.chat[0].messages[0]["content"] == "\ud800 lone"


def test_root_path_behind_a_stripping_proxy(vllm_app: Any) -> None:
    # vLLM --root-path /prefix behind a proxy that strips it: the client signed /prefix/v1/...
    app, seen = vllm_app(SECRET, "--root-path", "/prefix")
    body = json.dumps(chat_body()).encode()
    (response,) = send(app, [(CHAT, body, signed("/prefix" + CHAT, body))])
    assert response.status_code == 200, response.text
    assert len(seen.chat) == 1


RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"
ROUTE_BODIES = {
    RESPONSES: {"model": "smol", "input": "Hi", "max_output_tokens": 1, "store": False},
    MESSAGES: {"model": "smol", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]},
}
PREFILL_KV = {"do_remote_decode": True, "do_remote_prefill": False, "return_prompt_token_ids": True}


@pytest.mark.parametrize("path", [RESPONSES, MESSAGES])
def test_responses_and_messages_need_a_signature_for_kv_transfer_params(vllm_app: Any, path: str) -> None:
    app, seen = vllm_app(SECRET)
    records = seen.responses if path == RESPONSES else seen.messages
    plain = json.dumps(ROUTE_BODIES[path]).encode()
    forwarded = json.dumps({**ROUTE_BODIES[path], "kv_transfer_params": KV}).encode()
    prefill = json.dumps({**ROUTE_BODIES[path], "kv_transfer_params": PREFILL_KV}).encode()
    responses = send(
        app,
        [
            (path, plain, {}),  # no kv_transfer_params: not the guard's business
            (path, forwarded, {}),  # forwarded ids and a remote host, unsigned
            (path, prefill, {}),  # a prefill leg, unsigned
            (path, forwarded, signed(CHAT, forwarded)),  # signed for another route
            (path, forwarded, signed(path, forwarded)),
            (path, prefill, signed(path, prefill)),
        ],
    )
    assert [r.status_code for r in responses] == [200, 403, 403, 403, 200, 200], [r.text for r in responses]
    assert [r.kv_transfer_params for r in records] == [None, KV, PREFILL_KV]
