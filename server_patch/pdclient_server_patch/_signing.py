"""Signature over ``kv_transfer_params``: the one spec both sides implement.

Dependency-free on purpose: pdclient mirrors these few lines on the client side, and
any other router can reimplement them from this docstring alone.

Spec (version 1)
----------------
- ``params`` is the ``kv_transfer_params`` JSON object of one request, exactly as sent.
- Remove the key ``"pdclient_signature"`` (the signature itself) if present.
- Encode the rest canonically:
  ``json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False)``,
  then UTF-8. (Keys sorted at every depth, no whitespace, non-ASCII kept as-is,
  integers in decimal, floats as Python's shortest round-trip ``repr``.)
- Signature = lowercase hex of HMAC-SHA256(key = secret as UTF-8, msg = those bytes).
- Send it as ``kv_transfer_params["pdclient_signature"]``.

The client signs what it sends on each leg: the prefill leg's params, and the decode
leg's params (the dict the prefill server returned, plus ``prompt_token_ids``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

SIGNATURE_KEY = "pdclient_signature"


def canonical_bytes(params: dict[str, Any]) -> bytes:
    """The bytes that are signed: ``params`` minus the signature, canonical JSON."""
    rest = {k: v for k, v in params.items() if k != SIGNATURE_KEY}
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def sign_kv_transfer_params(params: dict[str, Any], secret: str) -> str:
    """Hex HMAC-SHA256 of ``canonical_bytes(params)`` keyed by ``secret``."""
    return hmac.new(secret.encode("utf-8"), canonical_bytes(params), hashlib.sha256).hexdigest()


def verify_kv_transfer_params(params: dict[str, Any], secret: str) -> bool:
    """Whether ``params[SIGNATURE_KEY]`` is the valid signature of the rest of ``params``."""
    return verified_canonical_bytes(params, secret) is not None


def verified_canonical_bytes(params: dict[str, Any], secret: str) -> bytes | None:
    """``canonical_bytes(params)`` if the signature is valid, else None.

    The server reuses these bytes as the signature-free ``kv_transfer_params`` it passes
    on, so the (large) id list is serialized once.
    """
    signature = params.get(SIGNATURE_KEY)
    if not isinstance(signature, str):
        return None
    try:
        canonical = canonical_bytes(params)
    except (TypeError, ValueError):  # not JSON-encodable (cannot come from a JSON body)
        return None
    expected = hmac.new(secret.encode("utf-8"), canonical, hashlib.sha256).hexdigest()
    # Constant-time comparison: the signature must not leak through timing.
    return canonical if hmac.compare_digest(expected, signature) else None
