"""reuse_secret: every handoff leg carries an X-PDClient-Signature (spec v2) the server patch accepts."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import respx

from pdclient.wire import DEFAULT_TTL, SIGNATURE_HEADER, signature
from tests.fake_vllm import NIXL_PARAMS, FakeVLLM
from tests.twins import Twin

SERVER_SIGNING = Path(__file__).parents[2] / "server_patch" / "pdclient_server_patch" / "_signing.py"
VECTOR_BODY = b'{"kv_transfer_params":{"do_remote_prefill":true,"prompt_token_ids":[1,2,3]}}'
VECTOR_NONCE = "000102030405060708090a0b0c0d0e0f"
VECTOR_S = "8eb553b5886fecad9cb9a2b8ca22fdf98bf72f2443e465d4f2ec3aa110b9106c"


def server_signing() -> Any:
    """The server patch's own module, loaded from its file (pdclient never imports the patch)."""
    spec = importlib.util.spec_from_file_location("server_signing", SERVER_SIGNING)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_known_vector() -> None:
    # Pinned on the server side too (tests/server_patch/test_signing.py) and in both docstrings.
    header = signature(
        "secret", "POST", "/v1/chat/completions", VECTOR_BODY, ttl=0, now=1_700_000_000, nonce=VECTOR_NONCE
    )
    assert header == f"v2;t=1700000000;n={VECTOR_NONCE};s={VECTOR_S}"


def test_header_format_and_fresh_nonces() -> None:
    now = time.time()
    headers = [signature("k", "post", "/v1/completions", b"{}") for _ in range(3)]
    nonces = set()
    for header in headers:
        version, t, n, s = header.split(";")
        assert version == "v2" and s.startswith("s=") and len(s) == 2 + 64
        assert int(now + DEFAULT_TTL) <= int(t[2:]) <= now + DEFAULT_TTL + 1
        assert n.startswith("n=") and len(n) == 2 + 32 and n[2:] == n[2:].lower()
        nonces.add(n)
    assert len(nonces) == 3
    with pytest.raises(ValueError, match="nonce"):
        signature("k", "POST", "/", b"", nonce="NOT-HEX")


@pytest.mark.parametrize(
    "body",
    [
        b"",
        VECTOR_BODY,
        json.dumps({"kv_transfer_params": {**NIXL_PARAMS, "prompt_token_ids": list(range(2000))}}).encode(),
        '{"m": "h\u00e9llo \u2713 \\ud800"}'.encode(),
    ],
    ids=["empty", "vector", "2k-ids", "unicode-and-lone-surrogate"],
)
def test_the_server_accepts_the_clients_signature(body: bytes) -> None:
    server = server_signing()
    now = time.time()
    header = signature("s3cret", "post", "/v1/chat/completions", body)
    t, nonce = server.verify("s3cret", "POST", ("/v1/chat/completions",), body, header, now=now)
    assert f"t={t};n={nonce};" in header
    for secret, method, path, other in (
        ("other", "POST", "/v1/chat/completions", body),
        ("s3cret", "PUT", "/v1/chat/completions", body),
        ("s3cret", "POST", "/v1/completions", body),
        ("s3cret", "POST", "/v1/chat/completions", body + b" "),
    ):
        with pytest.raises(server.SignatureError, match="does not match"):
            server.verify(secret, method, (path,), other, header, now=now)
    with pytest.raises(server.SignatureError, match="expired"):
        server.verify("s3cret", "POST", ("/v1/chat/completions",), body, header, now=now + DEFAULT_TTL + 2)


def verified(request: httpx.Request, secret: str) -> str:
    """The nonce of a leg request whose signature the server's own code accepts."""
    server = server_signing()
    header = request.headers[SIGNATURE_HEADER]
    _, nonce = server.verify(secret, request.method, (request.url.path,), request.content, header, now=time.time())
    assert b"pdclient_signature" not in request.content  # spec v1's in-body field is gone
    return str(nonce)


async def test_both_legs_are_signed(mode: str, pd_routes: respx.MockRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLIENT_REUSE_SECRET", "from-env")
    for secret, twin in (("given", Twin(mode, reuse_secret="given")), ("from-env", Twin(mode))):
        pd_routes.reset()
        await twin.chat(messages=[{"role": "user", "content": "sign me"}])
        nonces = {verified(pd_routes[leg].calls[0].request, secret) for leg in ("prefill", "decode")}
        assert len(nonces) == 2  # one nonce per request sent


async def test_each_attempt_gets_a_fresh_nonce(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["prefill"].mock(side_effect=[httpx.Response(503, text="busy"), FakeVLLM().respond])
    await Twin(mode, reuse_secret="k").chat(messages=[{"role": "user", "content": "retry me"}])
    first, second = (call.request for call in pd_routes["prefill"].calls)
    assert first.content == second.content
    assert verified(first, "k") != verified(second, "k")


async def test_no_secret_no_signature(mode: str, pd_routes: respx.MockRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCLIENT_REUSE_SECRET", raising=False)
    await Twin(mode).chat(messages=[{"role": "user", "content": "x"}])
    for leg in ("prefill", "decode"):
        assert SIGNATURE_HEADER not in pd_routes[leg].calls[0].request.headers
