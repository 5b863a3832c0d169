"""The guard as an ASGI middleware, in-process: its rules on a stand-in app, then on vLLM's real routes.

Issue 13 items: 1 (UTF-16/32 bodies), 2 (generate's extra_args), 3 (signatures bound to
their request, expiry, nonce), 4 (never a 500). The live test repeats them on a server.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx
import pytest
from pdclient_server_patch import _guard, _verify
from pdclient_server_patch._signing import SIGNATURE_HEADER, signature

SECRET = "test-secret"
PATH = "/v1/chat/completions"
KV = {"do_remote_prefill": True, "remote_host": "10.0.0.2", "remote_block_ids": [4, 5], "prompt_token_ids": [1, 2, 3]}
ENCODINGS = ["utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be", "utf-16", "utf-32", "utf-8-sig"]


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


def post(
    body: Any,
    secret: str | None = SECRET,
    *,
    path: str = PATH,
    root_path: str = "",
    nonces: _guard.NonceMemory | None = None,
    **kwargs: Any,
) -> tuple[httpx.Response, App]:
    inner = App()
    middleware = _guard.PDClientMiddleware(inner, secret, nonces=nonces)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=middleware, root_path=root_path)
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            return await client.post(path, content=content, **kwargs)

    return asyncio.run(go()), inner


def signed_headers(content: bytes, path: str = PATH, **kwargs: Any) -> dict[str, str]:
    return {SIGNATURE_HEADER: signature(SECRET, "POST", path, content, **kwargs)}


def chat(kv: Any = None, **extra: Any) -> dict[str, Any]:
    return {"model": "smol", "messages": [{"role": "user", "content": "Hi"}], "kv_transfer_params": kv, **extra}


def encode(payload: Any) -> bytes:
    return json.dumps(payload).encode()


def assert_refused(response: httpx.Response, app: App, status: int = 403, why: str = "") -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == "kv_transfer_params"
    assert why in error["message"], error["message"]
    assert app.seen == []


# -- unsigned bodies: what they may not carry -------------------------------------------


def test_unsigned_is_403_and_never_reaches_vllm() -> None:
    response, app = post(chat(KV))
    assert_refused(response, app, why=f"no {SIGNATURE_HEADER} header")


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_unsigned_utf16_utf32_bodies_are_403(encoding: str) -> None:
    # Issue 13 item 1: json.loads(bytes) detects these encodings itself (so do vLLM's routes).
    content = json.dumps(chat(KV)).encode(encoding)
    assert json.loads(content)["kv_transfer_params"] == KV
    assert encoding == "utf-8-sig" or b"kv_transfer_params" not in content  # what v1 looked for
    response, app = post(content)
    assert_refused(response, app)


@pytest.mark.parametrize(
    "payload",
    [
        {"token_ids": [1, 2], "sampling_params": {"max_tokens": 4, "extra_args": {"kv_transfer_params": KV}}},
        chat(None, vllm_xargs={"kv_transfer_params": "x"}),
        [{"deep": [{"kv_transfer_params": {}}]}],
    ],
    ids=["generate-extra_args", "vllm_xargs", "any-depth"],
)
def test_unsigned_nested_params_are_403(payload: Any) -> None:
    # Issue 13 item 2: /inference/v1/generate reads sampling_params.extra_args.kv_transfer_params.
    response, app = post(payload, path="/inference/v1/generate")
    assert_refused(response, app)


def test_escaped_and_duplicate_keys_do_not_slip_through() -> None:
    escaped = encode(chat(KV)).replace(b"kv_transfer_params", b"kv\\u005ftransfer_params")
    assert b"kv_transfer_params" not in escaped and json.loads(escaped)["kv_transfer_params"] == KV
    every_char = "".join(f"\\u{ord(c):04X}" for c in "kv_transfer_params").encode()
    fully_escaped = encode(chat(KV)).replace(b"kv_transfer_params", every_char).decode().encode("utf-16")
    hidden = b'{"kv_transfer_params": {"remote_host": "evil"}, "kv_transfer_params": null}'
    assert json.loads(hidden)["kv_transfer_params"] is None  # a parser keeping the first would differ
    for content in (escaped, fully_escaped, hidden):
        response, app = post(content)
        assert_refused(response, app)


@pytest.mark.parametrize(
    "content",
    [
        b"not json kv_transfer_params",
        b'{"kv_transfer_params": {"a": 1}',  # truncated
        b'{"m": "\xff\xfe", "kv_transfer_params": {}}',  # not UTF-8
        b"[" * 100_000 + b'{"kv_transfer_params": 1}' + b"]" * 100_000,  # too deep for json
        b'{"m": "\\u0041"' + b" " * 10 + b"\x00",  # escape of an ASCII char, then not JSON
        "{}".encode("utf-16-le") + b"\x00",  # odd length: not UTF-16
    ],
    ids=["not-json", "truncated", "bad-utf8", "too-deep", "escape-not-json", "bad-utf16"],
)
def test_what_cannot_be_checked_is_403(content: bytes) -> None:
    response, app = post(content)
    assert_refused(response, app)


@pytest.mark.parametrize(
    "payload",
    [
        b'{"model":"smol","prompt":"hi"}',
        encode(chat(None)),
        encode(chat(None, messages=[{"role": "user", "content": "what are kv_transfer_params?"}])),
        encode(chat(None)).decode().encode("utf-16"),
        json.dumps({"m": "h\u00e9llo \u2713"}).encode(),  # \\u escapes of non-ASCII text: no parse needed
        b"plain text, no key",
        b"",
    ],
)
def test_requests_without_params_pass_byte_for_byte(payload: bytes) -> None:
    response, app = post(payload)
    assert response.status_code == 200
    assert app.seen[0][0] == payload


def test_any_content_type_is_checked() -> None:
    response, app = post(chat(KV), headers={"Content-Type": "text/plain"})
    assert_refused(response, app)


def test_no_secret_no_check() -> None:
    payload = encode(chat(KV)).decode().encode("utf-16")
    response, app = post(payload, secret=None)
    assert response.status_code == 200 and app.seen[0][0] == payload


# -- signed requests -----------------------------------------------------------------------


def test_signed_passes_byte_for_byte() -> None:
    content = encode(chat(KV))
    response, app = post(content, headers={**signed_headers(content), "X-Request-Id": "req-42"})
    assert response.status_code == 200
    assert app.seen == [(content, "req-42")]


def test_signed_utf16_body_passes() -> None:
    content = encode(chat(KV)).decode().encode("utf-16")
    response, app = post(content, headers=signed_headers(content))
    assert response.status_code == 200 and app.seen[0][0] == content


def test_replay_is_403() -> None:
    # Issue 13 item 3: one memory of nonces per process, whatever app the request reaches.
    nonces = _guard.NonceMemory()
    content = encode(chat(KV))
    headers = signed_headers(content)
    assert post(content, nonces=nonces, headers=headers)[0].status_code == 200
    response, app = post(content, nonces=nonces, headers=headers)
    assert_refused(response, app, why="nonce already used")


@pytest.mark.parametrize(
    "other",
    [
        chat(KV, messages=[{"role": "user", "content": "Something else"}]),
        chat(KV, max_tokens=4000),
        chat({**KV, "remote_host": "evil.example"}),
        chat(KV, model="other"),
    ],
    ids=["messages", "max_tokens", "remote_host", "model"],
)
def test_signature_is_bound_to_its_body(other: dict[str, Any]) -> None:
    # Issue 13 item 3: a captured decode leg's signature is not valid for another request.
    headers = signed_headers(encode(chat(KV)))
    response, app = post(other, headers=headers)
    assert_refused(response, app, why="does not match this request")


def test_signature_is_bound_to_its_path() -> None:
    content = encode(chat(KV))
    response, app = post(content, path="/v1/completions", headers=signed_headers(content))
    assert_refused(response, app, why="does not match this request")


def test_expired_and_far_future_are_403() -> None:
    content = encode(chat(KV))
    response, app = post(content, headers=signed_headers(content, ttl=60, now=time.time() - 120))
    assert_refused(response, app, why="expired")
    response, app = post(content, headers=signed_headers(content, ttl=3600))
    assert_refused(response, app, why="too far ahead")


def test_malformed_or_repeated_header_is_403() -> None:
    content = encode(chat(KV))
    v1 = {**KV, "pdclient_signature": "0" * 64}
    response, app = post(chat(v1), headers={SIGNATURE_HEADER: "0" * 64})
    assert_refused(response, app, why="malformed")
    one = signed_headers(content)[SIGNATURE_HEADER]
    response, app = post(content, headers=[(SIGNATURE_HEADER, one), (SIGNATURE_HEADER, one)])
    assert_refused(response, app, why="2 x-pdclient-signature headers")


def test_bad_signature_without_params_passes() -> None:
    content = encode(chat(None))
    response, app = post(content, headers={SIGNATURE_HEADER: "garbage"})
    assert response.status_code == 200 and app.seen[0][0] == content


def test_root_path_behind_a_stripping_proxy() -> None:
    # The client signs the path it sent (/prefix/...); the proxy strips /prefix; vLLM runs
    # with --root-path /prefix, so the guard sees path /v1/... and root_path /prefix.
    content = encode(chat(KV))
    response, _ = post(content, root_path="/prefix", headers=signed_headers(content, path="/prefix" + PATH))
    assert response.status_code == 200
    response, _ = post(content, root_path="/prefix", headers=signed_headers(content))
    assert response.status_code == 200
    response, app = post(content, root_path="/other", headers=signed_headers(content, path="/prefix" + PATH))
    assert_refused(response, app, why="does not match")


def test_lone_surrogate_is_never_a_500() -> None:
    # Issue 13 item 4: v1 re-encoded the parsed body and raised UnicodeEncodeError (a 500).
    content = encode(chat(KV, messages=[{"role": "user", "content": "\ud800 lone"}]))
    assert b"\\ud800" in content
    response, app = post(content, headers=signed_headers(content))
    assert response.status_code == 200 and app.seen[0][0] == content
    for unsigned in (content, content.replace(b"\\ud800", b"\xed\xa0\x80")):  # escaped, then raw bytes
        response, app = post(unsigned)
        assert_refused(response, app)


def test_a_failing_guard_is_a_400_not_a_500(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(body: bytes) -> str | None:
        raise MemoryError("out of memory")

    monkeypatch.setattr(_guard, "carried_kv_params", boom)
    response, app = post(chat(KV))
    assert_refused(response, app, status=400, why="could not check this request (MemoryError: out of memory)")


def test_nonce_memory_forgets_expired_and_is_bounded() -> None:
    memory = _guard.NonceMemory(limit=2)
    assert memory.accept(100, "a" * 32, now=50) is None
    assert memory.accept(100, "a" * 32, now=60) == "nonce already used (a replayed request)"
    assert memory.accept(100, "b" * 32, now=60) is None
    assert "replay memory full" in str(memory.accept(200, "c" * 32, now=60))
    assert memory.accept(200, "c" * 32, now=100.5) is None  # t=100 expired: forgotten
    assert len(memory) == 1


def test_install_wraps_fastapi_apps_once() -> None:
    from fastapi import FastAPI

    original = FastAPI.build_middleware_stack
    try:
        _guard.install(SECRET)
        _guard.install(SECRET)
        assert FastAPI.build_middleware_stack.__wrapped__ is original  # type: ignore[attr-defined]
        app = FastAPI()

        @app.post("/v1/chat/completions")
        async def chat_route(payload: dict[str, Any]) -> dict[str, Any]:
            return payload

        content = encode(chat(KV))

        async def go() -> list[httpx.Response]:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://vllm") as client:
                json_type = {"content-type": "application/json"}
                return [
                    await client.post(PATH, content=content, headers=json_type),
                    await client.post(PATH, content=content, headers={**json_type, **signed_headers(content)}),
                ]

        unsigned, ok = asyncio.run(go())
        assert unsigned.status_code == 403
        assert ok.status_code == 200 and ok.json()["kv_transfer_params"] == KV
    finally:
        FastAPI.build_middleware_stack = original  # type: ignore[method-assign]
