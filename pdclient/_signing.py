"""HMAC signature over ``kv_transfer_params``: the client half of the server patch's guard.

Mirrors ``server_patch/pdclient_server_patch/_signing.py`` (spec version 1), which the
decode and prefill servers check when ``PDCLIENT_REUSE_SECRET`` is set there:
HMAC-SHA256, keyed by the secret, over the params minus ``pdclient_signature`` encoded
as ``json.dumps(sort_keys=True, separators=(",", ":"), ensure_ascii=False)`` in UTF-8,
sent as lowercase hex in ``kv_transfer_params["pdclient_signature"]``.

stdlib json, not orjson: the bytes must match the server's encoder exactly (the two
differ on some floats, e.g. ``1e+16`` against ``1e16``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

SECRET_ENV = "PDCLIENT_REUSE_SECRET"
SIGNATURE_KEY = "pdclient_signature"


def sign_kv_transfer_params(params: dict[str, Any], secret: str) -> str:
    rest = {k: v for k, v in params.items() if k != SIGNATURE_KEY}
    canonical = json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return hmac.new(secret.encode("utf-8"), canonical, hashlib.sha256).hexdigest()


def signed(body: dict[str, Any], secret: str | None) -> dict[str, Any]:
    """``body`` with its ``kv_transfer_params`` signed, when there are both a secret and params."""
    params = body.get("kv_transfer_params")
    if not secret or not isinstance(params, dict):
        return body
    return {**body, "kv_transfer_params": {**params, SIGNATURE_KEY: sign_kv_transfer_params(params, secret)}}
