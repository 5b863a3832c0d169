"""Request signatures for servers whose server patch guards ``kv_transfer_params`` (spec v2).

The client half of ``server_patch/pdclient_server_patch/_signing.py``; the spec lives
there. Each leg attempt carries ``X-PDClient-Signature: v2;t=<expiry>;n=<nonce>;s=<hmac>``,
an HMAC-SHA256 over the method, path, expiry, nonce and the exact body bytes, so nothing
is re-encoded to sign it and a signature is good for one request only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time

SECRET_ENV = "PDCLIENT_REUSE_SECRET"
SIGNATURE_HEADER = "x-pdclient-signature"
DEFAULT_TTL = 60.0


def signature(
    secret: str,
    method: str,
    path: str,
    body: bytes,
    *,
    ttl: float = DEFAULT_TTL,
    now: float | None = None,
    nonce: str | None = None,
) -> str:
    """The ``X-PDClient-Signature`` header value for one request."""
    expiry = str(int((time.time() if now is None else now) + ttl)).encode()
    nonce_bytes = (nonce or secrets.token_hex(16)).encode()
    mac = hmac.new(secret.encode("utf-8"), b"pdclient-v2\n", hashlib.sha256)
    mac.update(method.upper().encode() + b"\n" + path.encode() + b"\n" + expiry + b"\n" + nonce_bytes + b"\n")
    mac.update(body)
    return f"v2;t={expiry.decode()};n={nonce_bytes.decode()};s={mac.hexdigest()}"
