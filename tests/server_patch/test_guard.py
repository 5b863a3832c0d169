"""The kv_transfer_params guard as an ASGI middleware, in-process (the live test repeats it on a server)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from pdclient_server_patch import _guard, _verify
from pdclient_server_patch._signing import SIGNATURE_KEY, sign_kv_transfer_params

SECRET = "test-secret"
KV = {"do_remote_prefill": True, "remote_host": "10.0.0.2", "remote_block_ids": [4, 5], "prompt_token_ids": [1, 2, 3]}


class App:
    """Stands in for vLLM: records what reached it."""

    def __init__(self) -> None:
        self.seen: list[tuple[bytes, str | None]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        self.seen.append((body, _verify.REQUEST_ID.get()))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{}"})


def post(body: Any, secret: str | None = SECRET, **kwargs: Any) -> tuple[httpx.Response, App]:
    inner = App()
    middleware = _guard.PDClientMiddleware(inner, secret)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=middleware)
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await client.post("/v1/chat/completions", content=content, **kwargs)

    return asyncio.run(go()), inner


def signed(kv: dict[str, Any], secret: str = SECRET) -> dict[str, Any]:
    return {**kv, SIGNATURE_KEY: sign_kv_transfer_params(kv, secret)}


def body(kv: Any) -> dict[str, Any]:
    return {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "kv_transfer_params": kv}


def test_unsigned_is_403_and_never_reaches_vllm() -> None:
    response, app = post(body(KV))
    assert response.status_code == 403
    assert response.json()["error"]["param"] == f"kv_transfer_params.{SIGNATURE_KEY}"
    assert app.seen == []


@pytest.mark.parametrize(
    "tamper",
    [
        lambda kv: kv.update(prompt_token_ids=[1, 2, 4]),
        lambda kv: kv.update(remote_host="evil.example"),
        lambda kv: kv.pop("remote_block_ids"),
        lambda kv: kv.update({SIGNATURE_KEY: sign_kv_transfer_params(KV, "wrong-secret")}),
    ],
    ids=["ids", "host", "dropped-key", "wrong-secret"],
)
def test_tampered_is_403(tamper: Any) -> None:
    kv = signed(KV)
    tamper(kv)
    response, app = post(body(kv))
    assert response.status_code == 403 and app.seen == []


def test_non_dict_params_are_403() -> None:
    response, app = post(body([1, 2]))
    assert response.status_code == 403 and app.seen == []


def test_signed_passes_without_the_signature() -> None:
    response, app = post(body(signed(KV)), headers={"X-Request-Id": "req-42"})
    assert response.status_code == 200
    ((seen, request_id),) = app.seen
    assert json.loads(seen) == body(KV)  # everything else unchanged
    assert request_id == "req-42"


def test_requests_without_params_are_untouched() -> None:
    for payload in (b'{"model":"smol","prompt":"hi"}', json.dumps(body(None)).encode(), b"not json kv_transfer_params"):
        response, app = post(payload)
        assert response.status_code == 200
        assert app.seen[0][0] == payload  # byte for byte


def test_no_secret_no_check() -> None:
    payload = json.dumps(body(KV)).encode()
    response, app = post(payload, secret=None)
    assert response.status_code == 200 and app.seen[0][0] == payload


def test_install_wraps_fastapi_apps_once() -> None:
    from fastapi import FastAPI

    original = FastAPI.build_middleware_stack
    try:
        _guard.install(SECRET)
        _guard.install(SECRET)
        assert FastAPI.build_middleware_stack.__wrapped__ is original  # type: ignore[attr-defined]
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat(payload: dict[str, Any]) -> dict[str, Any]:
            return payload

        async def go() -> list[httpx.Response]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
                return [
                    await client.post("/v1/chat/completions", json=body(KV)),
                    await client.post("/v1/chat/completions", json=body(signed(KV))),
                ]

        unsigned, ok = asyncio.run(go())
        assert unsigned.status_code == 403
        assert ok.status_code == 200 and ok.json()["kv_transfer_params"] == KV
    finally:
        FastAPI.build_middleware_stack = original  # type: ignore[method-assign]


def test_params_only_body_stays_valid_json() -> None:
    response, app = post({"kv_transfer_params": signed(KV)})
    assert response.status_code == 200
    assert json.loads(app.seen[0][0]) == {"kv_transfer_params": KV}


def test_escaped_key_does_not_slip_through() -> None:
    payload = json.dumps(body(KV)).replace("kv_transfer_params", "kv\\u005ftransfer_params").encode()
    assert b"kv_transfer_params" not in payload and json.loads(payload)["kv_transfer_params"] == KV
    response, app = post(payload)
    assert response.status_code == 403 and app.seen == []


def test_any_content_type_is_checked() -> None:
    response, app = post(body(KV), headers={"Content-Type": "text/plain"})
    assert response.status_code == 403 and app.seen == []
