"""Request signatures for servers guarded by the server patch: the client half (spec v2).

Twin of ``server_patch/pdclient_server_patch/_signing.py``, which the decode and prefill
servers check when ``PDCLIENT_REUSE_SECRET`` is set there. Dependency-free.

Spec (version 2; version 1, a signature inside ``kv_transfer_params``, is gone: it was
not bound to its request and could be replayed)
- Header ``X-PDClient-Signature: v2;t=<expiry, integer unix seconds>;n=<nonce, 32
  lowercase hex>;s=<64 lowercase hex>``.
- ``s`` = HMAC-SHA256(key = secret as UTF-8, msg = ``b"pdclient-v2\\n" + METHOD + b"\\n" +
  PATH + b"\\n" + t + b"\\n" + n + b"\\n" + BODY``): METHOD upper-case ASCII, PATH the URL
  path as sent (no query; UTF-8), ``t`` and ``n`` as in the header, BODY the exact body
  bytes. The whole body is covered, so nothing is re-encoded.
- A fresh nonce per request sent (every retry too); ``t`` = now + ``ttl``.
- The server accepts ``now <= t <= now + max_age`` (300 s by default), a matching HMAC
  and a nonce it has not accepted before.

Known vector: secret ``secret``, ``POST``, ``/v1/chat/completions``, t ``1700000000``,
n ``000102030405060708090a0b0c0d0e0f``, body
``{"kv_transfer_params":{"do_remote_prefill":true,"prompt_token_ids":[1,2,3]}}`` give
s ``8eb553b5886fecad9cb9a2b8ca22fdf98bf72f2443e465d4f2ec3aa110b9106c``.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import time

SECRET_ENV = "PDCLIENT_REUSE_SECRET"
SIGNATURE_HEADER = "x-pdclient-signature"
DEFAULT_TTL = 60.0

_DOMAIN = b"pdclient-v2\n"
_NONCE = re.compile(r"[0-9a-f]{32}")


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
    """The ``X-PDClient-Signature`` value for one request: call it once per request sent.

    ``body`` is the exact content sent; ``path`` the URL path without query. A random
    nonce is drawn unless one is given (tests); ``now`` defaults to ``time.time()``.
    """
    t = str(int((time.time() if now is None else now) + ttl))
    n = secrets.token_hex(16) if nonce is None else nonce
    if not _NONCE.fullmatch(n):
        raise ValueError(f"nonce must be 32 lowercase hex characters, got {n!r}")
    head = b"\n".join((method.upper().encode("ascii"), path.encode("utf-8"), t.encode("ascii"), n.encode("ascii")))
    mac = hmac.new(secret.encode("utf-8"), _DOMAIN + head + b"\n", hashlib.sha256)
    mac.update(body)  # no copy of a large body
    return f"v2;t={t};n={n};s={mac.hexdigest()}"
