"""Callers of the proxy are not its operator: their per-call options may not loosen its
settings unless it allows them, and each caller's state is its tenant's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdclient import CallView, PDObserver, PDOptions, PDTrace
from pdclient.cli import build_parser
from pdclient.cli.serve import config_from_args
from pdclient.routing import TENANT_EXTENSION
from pdclient.serve import ServeConfig, create_app
from tests.stubserver import StubServer

from .conftest import MESSAGES, config_for, running_proxy

CHAT = {"model": "m", "messages": MESSAGES}
P, D = "http://p:8100/v1", "http://d:8200/v1"


def parse(*argv: str) -> ServeConfig:
    return config_from_args(build_parser().parse_args(["serve", "--prefill", P, "--decode", D, *argv]))


# -- allow_call_overrides -------------------------------------------------------------------


def test_call_overrides_are_off_in_the_proxy_unless_allowed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCLIENT_SERVE_ALLOW_CALL_OVERRIDES", raising=False)
    assert PDOptions(prefill_base_url=P, decode_base_url=D).allow_call_overrides is True  # the library's default
    # Whatever the options say, the proxy's own setting decides: off unless given.
    given = ServeConfig(options=PDOptions(prefill_base_url=P, decode_base_url=D, allow_call_overrides=True))
    assert create_app(given).state.proxy.transport.options.allow_call_overrides is False
    assert create_app(parse()).state.proxy.transport.options.allow_call_overrides is False
    assert create_app(parse("--allow-call-overrides")).state.proxy.transport.options.allow_call_overrides is True
    file = tmp_path / "serve.json"
    file.write_text(json.dumps({"allow-call-overrides": True}))
    assert parse("--config", str(file)).allow_call_overrides is True
    monkeypatch.setenv("PDCLIENT_SERVE_ALLOW_CALL_OVERRIDES", "on")
    config = parse()
    assert config.allow_call_overrides is True and ServeConfig.from_json(config.to_json()) == config  # to workers


async def test_a_caller_cannot_loosen_the_operators_settings(stub: StubServer) -> None:
    loosening = {"max_decode_migrations": 5}
    with running_proxy(config_for(stub.url, max_decode_migrations=1)) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            refused = await http.post("/chat/completions", json={**CHAT, "stream": True, "pdclient": loosening})
    assert refused.status_code == 400 and "max_decode_migrations" in refused.json()["error"]["message"]
    assert stub.received == []
    with running_proxy(config_for(stub.url, max_decode_migrations=1, allow_call_overrides=True)) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            allowed = await http.post("/chat/completions", json={**CHAT, "stream": True, "pdclient": loosening})
    assert allowed.status_code == 200


# -- tenants --------------------------------------------------------------------------------


class Tenants(PDObserver):
    """The tenant each call's request carried into the transport."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def on_call_end(self, call: CallView, trace: PDTrace) -> None:
        self.seen.append(call.request.extensions.get(TENANT_EXTENSION, "absent"))


async def test_each_api_key_is_a_tenant_of_its_own(stub: StubServer) -> None:
    tenants = Tenants()
    with running_proxy(config_for(stub.url, api_keys=("key-one", "key-two"), observers=[tenants])) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            for key in ("key-one", "key-two", "key-one"):
                response = await http.post("/chat/completions", json=CHAT, headers={"authorization": f"Bearer {key}"})
                assert response.status_code == 200
            await http.get("/models", headers={"authorization": "Bearer key-two"})
    one, two, one_again, models = tenants.seen
    assert isinstance(one, str) and isinstance(two, str) and one != two
    assert one_again == one and models == two
    assert len(one) == 32 and all("key" not in t for t in tenants.seen)  # a digest, not the key


async def test_a_tenant_is_the_same_in_every_worker_and_replica(stub: StubServer) -> None:
    """Another app (another worker process, another replica) gives a key the same tenant,
    so state kept per tenant can be found wherever the caller's next request lands."""
    seen = []
    for _ in range(2):
        tenants = Tenants()
        with running_proxy(config_for(stub.url, api_keys=("key-one",), observers=[tenants])) as proxy:
            async with httpx.AsyncClient(base_url=proxy.base_url) as http:
                await http.post("/chat/completions", json=CHAT, headers={"authorization": "Bearer key-one"})
        seen += tenants.seen
    first, second = seen
    assert first == second and len(first) == 32 and "key" not in first
    # The digest of the header, in its own domain: the same text as a header names another tenant.
    header = Tenants()
    config = config_for(stub.url, tenant_header="X-Tenant", observers=[header])
    with running_proxy(config) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            await http.post("/chat/completions", json=CHAT, headers={"x-tenant": "Bearer key-one"})
    assert header.seen[0] != first


async def test_without_a_key_callers_share_no_tenant(stub: StubServer) -> None:
    tenants = Tenants()
    with running_proxy(config_for(stub.url, observers=[tenants])) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            await http.post("/chat/completions", json=CHAT)
            await http.post("/chat/completions", json=CHAT, headers={"authorization": "Bearer anything"})
    assert tenants.seen[0] == "absent" and tenants.seen[1] != "absent" and len(tenants.seen[1]) == 32


async def test_the_operator_may_name_a_tenant_header(stub: StubServer) -> None:
    tenants = Tenants()
    config = config_for(stub.url, tenant_header="X-Tenant", api_keys=("shared",), observers=[tenants])
    with running_proxy(config) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url, headers={"authorization": "Bearer shared"}) as http:
            for tenant in ("acme", "globex", "acme"):
                response = await http.post("/chat/completions", json=CHAT, headers={"x-tenant": tenant})
                assert response.status_code == 200
            missing = await http.post("/chat/completions", json=CHAT)
    acme, globex, acme_again = tenants.seen
    assert acme == acme_again != globex and "acme" not in acme
    assert missing.status_code == 400 and "X-Tenant header" in missing.json()["error"]["message"]
    assert len(stub.received) == 6  # the refused call reached no server


@pytest.mark.parametrize("name", ["", "X Tenant", "x-tenant:", "tenant\n"])
def test_a_tenant_header_must_be_a_header_name(name: str) -> None:
    from pdclient import PDConfigError

    with pytest.raises(PDConfigError, match="tenant_header"):
        ServeConfig(options=PDOptions(prefill_base_url=P, decode_base_url=D), tenant_header=name)
