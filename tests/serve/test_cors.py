"""``--allowed-origins``: browsers on those origins may call the proxy (CORS); off by default."""

from __future__ import annotations

import httpx
import pytest

from pdclient import PDConfigError
from tests.stubserver import StubServer

from .conftest import MESSAGES, config_for, running_proxy

CHAT = {"model": "m", "messages": MESSAGES}
APP = "https://app.example"
PREFLIGHT = {
    "origin": APP,
    "access-control-request-method": "POST",
    "access-control-request-headers": "authorization, content-type",
}


async def test_a_preflight_needs_no_key_and_allowed_origins_get_cors_headers(stub: StubServer) -> None:
    with running_proxy(config_for(stub.url, api_keys=("k",), allowed_origins=(APP,))) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            preflight = await http.options("/v1/chat/completions", headers=PREFLIGHT)
            chat = await http.post(
                "/v1/chat/completions", json=CHAT, headers={"origin": APP, "authorization": "Bearer k"}
            )
            unauthorized = await http.post("/v1/chat/completions", json=CHAT, headers={"origin": APP})
            ready = await http.get("/ready", headers={"origin": APP})
            other = await http.post(
                "/v1/chat/completions",
                json=CHAT,
                headers={"origin": "https://evil.example", "authorization": "Bearer k"},
            )
            other_preflight = await http.options(
                "/v1/chat/completions", headers={**PREFLIGHT, "origin": "https://evil.example"}
            )
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == APP
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert chat.status_code == 200 and chat.headers["access-control-allow-origin"] == APP
    assert "x-request-id" in chat.headers["access-control-expose-headers"].lower()
    # The browser reads the 401 too (it can tell a missing key from a network error).
    assert unauthorized.status_code == 401 and unauthorized.headers["access-control-allow-origin"] == APP
    assert ready.headers["access-control-allow-origin"] == APP
    # Another origin: served (CORS is the browser's rule), but without the header a browser needs.
    assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
    assert other_preflight.status_code == 400 and "access-control-allow-origin" not in other_preflight.headers
    assert [r.leg for r in stub.received] == ["prefill", "decode", "prefill", "decode"]  # no preflight went on


async def test_any_origin(stub: StubServer) -> None:
    with running_proxy(config_for(stub.url, allowed_origins="*")) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            preflight = await http.options("/v1/chat/completions", headers=PREFLIGHT)
            chat = await http.post("/v1/chat/completions", json=CHAT, headers={"origin": "https://x.example"})
    assert preflight.status_code == 200 and preflight.headers["access-control-allow-origin"] in ("*", APP)
    assert chat.headers["access-control-allow-origin"] == "*"


async def test_off_by_default(stub: StubServer) -> None:
    with running_proxy(config_for(stub.url, api_keys=("k",))) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            preflight = await http.options("/v1/chat/completions", headers=PREFLIGHT)
            chat = await http.post(
                "/v1/chat/completions", json=CHAT, headers={"origin": APP, "authorization": "Bearer k"}
            )
    assert preflight.status_code == 401  # an OPTIONS request like any other: it needs the key
    assert not [h for h in (*preflight.headers, *chat.headers) if h.startswith("access-control-")]


@pytest.mark.parametrize("origin", ["https://app.example/", "app.example", "https://app.example/path", "ftp://x"])
def test_an_origin_is_a_scheme_and_a_host(origin: str) -> None:
    with pytest.raises(PDConfigError, match=r"allowed_origins: .* is not an origin"):
        config_for("http://p:8100/v1", allowed_origins=(origin,))
