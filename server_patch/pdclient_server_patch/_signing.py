"""Request signatures for the ``kv_transfer_params`` channel: the one spec both sides implement.

Dependency-free on purpose: ``pdclient/wire/_signing.py`` is this module's twin on the client
side, and any other router can reimplement the spec from this docstring alone.

Spec (version 2; version 1, a signature inside ``kv_transfer_params``, is gone: it was
not bound to its request and could be replayed)
--------------------------------------------------------------------------------
- The signature travels in the HTTP request header ``X-PDClient-Signature``::

      v2;t=<expiry: integer unix seconds>;n=<nonce: 32 lowercase hex>;s=<64 lowercase hex>

- ``s`` = lowercase hex of HMAC-SHA256 with key = the secret as UTF-8, over::

      b"pdclient-v2\\n" + METHOD + b"\\n" + PATH + b"\\n" + t + b"\\n" + n + b"\\n" + BODY

  METHOD upper-case ASCII (``POST``); PATH the URL path of the request, without query
  (``/v1/chat/completions``; percent-decoded, UTF-8; plain ASCII for every vLLM route);
  ``t`` and ``n`` exactly as in the header; BODY the exact request body bytes. The whole
  body is covered (messages, model, max_tokens, the ids, every kv param), so nothing
  is re-encoded and the body reaches vLLM byte for byte.
- A fresh random nonce for every request sent (every retry too), ``t`` = now + a short
  lifetime (pdclient: 60 s).
- The server accepts a signature when the header parses, ``now <= t <= now + max_age``
  (``PDCLIENT_REUSE_MAX_AGE``, default 300 s: bounds clock skew plus lifetime), the HMAC
  matches (constant-time comparison) and the nonce has not been accepted before (the
  guard remembers accepted nonces until their ``t``). The server compares PATH with the
  ASGI ``scope["path"]``, and also with ``root_path + path`` when vLLM runs with
  ``--root-path`` behind a proxy that strips that prefix (both reach the same route).

Known vector: secret ``secret``, method ``POST``, path ``/v1/chat/completions``,
t ``1700000000``, n ``000102030405060708090a0b0c0d0e0f``, body
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
VERSION = "v2"
DEFAULT_TTL = 60.0
DEFAULT_MAX_AGE = 300

_DOMAIN = b"pdclient-v2\n"
_NONCE = re.compile(r"[0-9a-f]{32}")
_HEADER = re.compile(r"v2;t=([0-9]{1,12});n=([0-9a-f]{32});s=([0-9a-f]{64})")


class SignatureError(ValueError):
    """Why a signature header was not accepted (the message names it)."""


def mac(secret: str, method: str, path: str, t: str, n: str, body: bytes) -> str:
    """Lowercase hex HMAC-SHA256 of the spec's message (``t``, ``n`` as in the header)."""
    head = b"\n".join((method.upper().encode("ascii"), path.encode("utf-8"), t.encode("ascii"), n.encode("ascii")))
    digest = hmac.new(secret.encode("utf-8"), _DOMAIN + head + b"\n", hashlib.sha256)
    digest.update(body)  # no copy of a large body
    return digest.hexdigest()


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
    """The ``X-PDClient-Signature`` value for one request (a fresh nonce unless given)."""
    t = str(int((time.time() if now is None else now) + ttl))
    n = secrets.token_hex(16) if nonce is None else nonce
    if not _NONCE.fullmatch(n):
        raise ValueError(f"nonce must be 32 lowercase hex characters, got {n!r}")
    return f"{VERSION};t={t};n={n};s={mac(secret, method, path, t, n, body)}"


def verify(
    secret: str,
    method: str,
    paths: tuple[str, ...],
    body: bytes,
    header: str,
    *,
    now: float,
    max_age: float = DEFAULT_MAX_AGE,
) -> tuple[int, str]:
    """``(t, nonce)`` of a valid signature of this request; ``SignatureError`` saying why not.

    ``paths``: the forms of the request's path to accept (see the spec). The nonce is
    not checked here: remembering nonces is the caller's (one memory per server process).
    """
    match = _HEADER.fullmatch(header.strip())
    if match is None:
        raise SignatureError(f"malformed {SIGNATURE_HEADER} header (expected v2;t=<unix s>;n=<32 hex>;s=<64 hex>)")
    t_text, nonce, given = match.groups()
    t = int(t_text)
    if t < now:
        raise SignatureError(f"signature expired (t={t}, server time {int(now)})")
    if t > now + max_age:
        raise SignatureError(
            f"signature expiry too far ahead (t={t}, server time {int(now)}, max_age {max_age:g} s): clock skew?"
        )
    for path in paths:
        if hmac.compare_digest(mac(secret, method, path, t_text, nonce, body), given):
            return t, nonce
    raise SignatureError("signature does not match this request (method, path, body or secret differ)")
