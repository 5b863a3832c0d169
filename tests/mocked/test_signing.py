"""reuse_secret: both legs carry kv_transfer_params signed exactly as the server patch checks them."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import respx

from pdclient._signing import SIGNATURE_KEY, sign_kv_transfer_params
from tests.fake_vllm import NIXL_PARAMS
from tests.twins import Twin

SERVER_SIGNING = Path(__file__).parents[1] / "server_patch" / "pdclient_server_patch" / "_signing.py"


def server_signing() -> object:
    """The server patch's own module, loaded from its file (pdclient never imports the patch)."""
    spec = importlib.util.spec_from_file_location("server_signing", SERVER_SIGNING)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "params",
    [
        {},
        NIXL_PARAMS,
        {**NIXL_PARAMS, "prompt_token_ids": list(range(2000))},
        {"nested": {"b": 1, "a": [1.5, None, True]}, "unicode": "héllo ✓", "big": 1e16},
    ],
)
def test_client_signature_is_the_servers(params: dict[str, object]) -> None:
    server = server_signing()
    signature = sign_kv_transfer_params(params, "s3cret")
    assert signature == server.sign_kv_transfer_params(params, "s3cret")  # type: ignore[attr-defined]
    assert server.verify_kv_transfer_params({**params, SIGNATURE_KEY: signature}, "s3cret")  # type: ignore[attr-defined]
    assert not server.verify_kv_transfer_params({**params, SIGNATURE_KEY: signature}, "other")  # type: ignore[attr-defined]


async def test_both_legs_are_signed(mode: str, pd_routes: respx.MockRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLIENT_REUSE_SECRET", "from-env")
    for secret, twin in (("given", Twin(mode, reuse_secret="given")), ("from-env", Twin(mode))):
        pd_routes.reset()
        await twin.chat(messages=[{"role": "user", "content": "sign me"}])
        for leg in ("prefill", "decode"):
            params = json.loads(pd_routes[leg].calls[0].request.content)["kv_transfer_params"]
            signature = params.pop(SIGNATURE_KEY)
            assert signature == sign_kv_transfer_params(params, secret), f"{leg} leg signed with {secret}"


async def test_no_secret_no_signature(mode: str, pd_routes: respx.MockRouter, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCLIENT_REUSE_SECRET", raising=False)
    await Twin(mode).chat(messages=[{"role": "user", "content": "x"}])
    assert SIGNATURE_KEY not in json.loads(pd_routes["decode"].calls[0].request.content)["kv_transfer_params"]
