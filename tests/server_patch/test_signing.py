"""The signing spec v2 (pure; pdclient/wire/_signing.py is its twin and is checked against it here)."""

from __future__ import annotations

import hashlib
import hmac
import importlib.util
import time
from pathlib import Path
from typing import Any

import pytest
from pdclient_server_patch._signing import SignatureError, mac, signature, verify

CLIENT_SIGNING = Path(__file__).parents[2] / "pdclient" / "wire" / "_signing.py"
PATH = "/v1/chat/completions"
VECTOR_BODY = b'{"kv_transfer_params":{"do_remote_prefill":true,"prompt_token_ids":[1,2,3]}}'
VECTOR_NONCE = "000102030405060708090a0b0c0d0e0f"
VECTOR_S = "8eb553b5886fecad9cb9a2b8ca22fdf98bf72f2443e465d4f2ec3aa110b9106c"


def client_signing() -> Any:
    """pdclient's own signer, loaded from its file (dependency-free; pdclient is not installed here)."""
    spec = importlib.util.spec_from_file_location("client_signing", CLIENT_SIGNING)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_known_vector() -> None:
    # The vector of both READMEs and docstrings; tests/mocked/test_signing.py pins it on the client.
    expected = f"v2;t=1700000000;n={VECTOR_NONCE};s={VECTOR_S}"
    assert signature("secret", "POST", PATH, VECTOR_BODY, ttl=0, now=1_700_000_000, nonce=VECTOR_NONCE) == expected
    twin = client_signing().signature
    assert twin("secret", "POST", PATH, VECTOR_BODY, ttl=0, now=1_700_000_000, nonce=VECTOR_NONCE) == expected


def test_spec_by_hand() -> None:
    message = b"pdclient-v2\nPOST\n" + PATH.encode() + b"\n1700000000\n" + VECTOR_NONCE.encode() + b"\n" + VECTOR_BODY
    assert hmac.new(b"secret", message, hashlib.sha256).hexdigest() == VECTOR_S
    assert mac("secret", "post", PATH, "1700000000", VECTOR_NONCE, VECTOR_BODY) == VECTOR_S


def test_client_and_server_agree() -> None:
    twin = client_signing()
    assert twin.SIGNATURE_HEADER == "x-pdclient-signature" and twin.SECRET_ENV == "PDCLIENT_REUSE_SECRET"
    body = '{"messages":[{"role":"user","content":"h\u00e9llo \\ud800"}],"max_tokens":4}'.encode()
    header = twin.signature("k\u00e9y", "POST", "/prefix/v1/completions", body)
    t, nonce = verify("k\u00e9y", "POST", ("/prefix/v1/completions",), body, header, now=time.time())
    assert header.startswith(f"v2;t={t};n={nonce};")


def test_accepted_window() -> None:
    now = 1_700_000_000.5
    for t in (1_700_000_001, 1_700_000_000 + 300):
        header = signature("k", "POST", PATH, b"{}", ttl=0, now=t, nonce=VECTOR_NONCE)
        assert verify("k", "POST", (PATH,), b"{}", header, now=now, max_age=300) == (t, VECTOR_NONCE)


@pytest.mark.parametrize(
    ("header", "why"),
    [
        ("", "malformed"),
        ("v1;t=1700000100;n=" + "0" * 32 + ";s=" + "0" * 64, "malformed"),
        ("v2;t=1700000100;n=" + "A" * 32 + ";s=" + "0" * 64, "malformed"),  # upper-case hex
        ("v2;n=" + "0" * 32 + ";t=1700000100;s=" + "0" * 64, "malformed"),  # order is fixed
        ("v2;t=1700000100;n=" + "0" * 31 + ";s=" + "0" * 64, "malformed"),
        ("v2;t=1700000100;n=" + "0" * 32 + ";s=" + "0" * 64 + ";x=1", "malformed"),
        ("v2;t=-5;n=" + "0" * 32 + ";s=" + "0" * 64, "malformed"),
        ("v2;t=1699999999;n=" + "0" * 32 + ";s=" + "0" * 64, "expired"),
        ("v2;t=1700000301;n=" + "0" * 32 + ";s=" + "0" * 64, "too far ahead"),
        ("v2;t=1700000100;n=" + "0" * 32 + ";s=" + "0" * 64, "does not match"),
    ],
)
def test_rejections(header: str, why: str) -> None:
    with pytest.raises(SignatureError, match=why):
        verify("k", "POST", (PATH,), b"{}", header, now=1_700_000_000, max_age=300)


def test_bound_to_method_path_body_and_secret() -> None:
    header = signature("k", "POST", PATH, VECTOR_BODY, now=1_700_000_000)
    for secret, method, path, body in (
        ("other", "POST", PATH, VECTOR_BODY),
        ("k", "PUT", PATH, VECTOR_BODY),
        ("k", "POST", "/v1/completions", VECTOR_BODY),
        ("k", "POST", PATH, VECTOR_BODY.replace(b"[1,2,3]", b"[1,2,4]")),
        ("k", "POST", PATH, VECTOR_BODY + b"\n"),
    ):
        with pytest.raises(SignatureError, match="does not match"):
            verify(secret, method, (path,), body, header, now=1_700_000_000)
    # One of several accepted path forms is enough (root_path, see the guard).
    assert verify("k", "POST", ("/other", PATH), VECTOR_BODY, header, now=1_700_000_000)
