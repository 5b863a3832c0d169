"""The signing spec (pure; pdclient mirrors it)."""

from __future__ import annotations

import hashlib
import hmac
import json

from pdclient_server_patch._signing import (
    SIGNATURE_KEY,
    canonical_bytes,
    sign_kv_transfer_params,
    verify_kv_transfer_params,
)

PARAMS = {"remote_host": "10.0.0.1", "do_remote_prefill": True, "remote_block_ids": [3, 1], "prompt_token_ids": [1, 2]}


def test_spec_by_hand() -> None:
    # Keys sorted at every depth, no whitespace, non-ASCII as UTF-8, signature field excluded.
    params = {"b": {"y": 1, "x": "é"}, "a": [1.5, None, False], SIGNATURE_KEY: "ignored"}
    assert canonical_bytes(params) == '{"a":[1.5,null,false],"b":{"x":"é","y":1}}'.encode()
    expected = hmac.new(b"s3cret", canonical_bytes(params), hashlib.sha256).hexdigest()
    assert sign_kv_transfer_params(params, "s3cret") == expected


def test_known_vector() -> None:
    # A fixed vector the client-side implementation is tested against too.
    params = {"do_remote_prefill": True, "prompt_token_ids": [1, 2, 3], "remote_host": "h"}
    assert canonical_bytes(params) == b'{"do_remote_prefill":true,"prompt_token_ids":[1,2,3],"remote_host":"h"}'
    assert sign_kv_transfer_params(params, "secret") == (
        "266884d71b2473edce7c72644e827af2167b97777f48f62bc7d4a920f5fb6fde"
    )


def test_roundtrip_through_json_and_key_order() -> None:
    signed = dict(PARAMS, **{SIGNATURE_KEY: sign_kv_transfer_params(PARAMS, "k")})
    received = json.loads(json.dumps(dict(reversed(list(signed.items())))))
    assert verify_kv_transfer_params(received, "k")


def test_rejections() -> None:
    signed = dict(PARAMS, **{SIGNATURE_KEY: sign_kv_transfer_params(PARAMS, "k")})
    assert not verify_kv_transfer_params(signed, "other-key")
    assert not verify_kv_transfer_params(dict(signed, prompt_token_ids=[1, 3]), "k")
    assert not verify_kv_transfer_params(dict(signed, remote_host="evil"), "k")
    assert not verify_kv_transfer_params(PARAMS, "k")  # unsigned
    assert not verify_kv_transfer_params(dict(PARAMS, **{SIGNATURE_KEY: 123}), "k")
    assert not verify_kv_transfer_params(dict(PARAMS, **{SIGNATURE_KEY: "00" * 32}), "k")
