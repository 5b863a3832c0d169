"""What the proxy shows: never the credentials of a server's URL (``/ready``, ``/metrics``,
error bodies, trace headers, logs, the command line's output), never the servers' names
to callers unless ``--trace-headers``; and URL credentials sent as the clients send them."""

from __future__ import annotations

import base64
import logging
from typing import Any

import httpx
import openai
import pytest

from pdclient import AsyncPDChatClient
from pdclient.cli import main
from pdclient.serve._logging import JSONFormatter, TextFormatter
from tests.stubserver import Fault, StubServer, closed_port_url

from .conftest import ANSWER, MESSAGES, ServeProcess, config_for, running_proxy

CHAT = {"model": "m", "messages": MESSAGES}
SECRET = "s3cret"


def with_credentials(url: str, password: str = SECRET) -> str:
    return url.replace("http://", f"http://user:{password}@", 1)


def formatted(records: list[logging.LogRecord]) -> str:
    """The records as the proxy's log lines show them, in both formats."""
    text = TextFormatter("%(name)s: %(message)s")
    return "\n".join(f"{text.format(r)}\n{JSONFormatter().format(r)}" for r in records)


# -- URL credentials: sent as Basic auth, as the in-process client sends them ----------------


@pytest.mark.parametrize("upstream_key", [None, "server-key"], ids=["no-key", "upstream-key"])
async def test_url_credentials_are_sent_as_the_client_sends_them(stub: StubServer, upstream_key: str | None) -> None:
    url = with_credentials(stub.url, "p@ss:word")
    async with AsyncPDChatClient(prefill_base_url=url, decode_base_url=url, api_key=upstream_key or "-") as client:
        chat = await client.chat.completions.create(model="m", messages=MESSAGES)
    assert chat.choices[0].message.content == ANSWER
    in_process = [r.headers.get("authorization") for r in stub.received]
    stub.clear()
    settings: dict[str, Any] = {"upstream_api_key": upstream_key} if upstream_key else {}
    with running_proxy(config_for(url, **settings)) as proxy:
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="-", max_retries=0) as client:
            chat = await client.chat.completions.create(model="m", messages=MESSAGES)
            await client.models.list()  # a pass-through too
    assert chat.choices[0].message.content == ANSWER
    basic = "Basic " + base64.b64encode(b"user:p@ss:word").decode()
    assert in_process == [basic, basic]
    assert [r.headers.get("authorization") for r in stub.received] == [basic, basic, basic]


# -- credentials never shown ---------------------------------------------------------------


async def test_url_credentials_are_never_shown(stub: StubServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdclient")
    prefill, decode = with_credentials(closed_port_url()), with_credentials(stub.url)
    settings = {"breaker_failures": 1, "on_prefill_failure": "fail", "allow_call_overrides": True}
    config = config_for(prefill, decode, trace_headers=True, **settings)
    shown: list[str] = []
    with running_proxy(config) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            for _ in range(2):  # a connect error, then the breaker is open: both errors, in full
                failed = await http.post("/v1/chat/completions", json=CHAT)
                assert failed.status_code in (502, 503)
                shown += [failed.text, str(failed.headers)]
            passed = await http.post(
                "/v1/chat/completions", json={**CHAT, "pdclient": {"on_prefill_failure": "decode"}}
            )
            shown += [passed.text, str(passed.headers)]
            assert passed.status_code == 200 and passed.headers["x-pd-decode-url"] == stub.url.replace(
                "http://", "http://***@"
            )
            ready = await http.get("/ready")
            metrics = await http.get("/metrics")
            shown += [ready.text, metrics.text]
    assert ready.json()["prefill"][0]["url"] == prefill.replace(f"user:{SECRET}@", "***@")
    assert 'endpoint="http://***@127.0.0.1' in metrics.text
    shown.append(formatted(caplog.records))
    assert "open" in shown[2]  # the second error named the pool's state, and its URL...
    assert all(SECRET not in text for text in shown)  # ...without its password


async def test_a_broken_decode_stream_is_logged_without_credentials(
    stub: StubServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pdclient")
    stub.inject(Fault(drop_after_events=2), leg="decode")
    body = {**CHAT, "stream": True}
    with running_proxy(config_for(with_credentials(stub.url))) as proxy:
        async with (
            httpx.AsyncClient(timeout=5) as http,
            http.stream("POST", proxy.base_url + "/chat/completions", json=body) as response,
        ):
            with pytest.raises(httpx.RemoteProtocolError):
                async for _ in response.aiter_lines():
                    pass
    text = formatted(caplog.records)
    assert "broke" in text and "***@" in text and SECRET not in text


def test_the_command_lines_errors_show_no_credentials(capsys: pytest.CaptureFixture[str]) -> None:
    url = "http://user:s3cret@d:8200/v1"
    assert main(["serve", "--prefill", url, "--decode", url, url]) == 1
    assert main(["serve", "--prefill", "ftp://user:s3cret@p/v1", "--decode", url]) == 1
    err = capsys.readouterr().err
    assert "lists the same URL twice" in err and "is not an http(s) URL" in err
    assert SECRET not in err and "***@" in err


def test_a_real_process_shows_no_credentials(stub: StubServer) -> None:
    url = with_credentials(stub.url)
    serve = ServeProcess("--prefill", url, "--decode", url, "--health-checks", "on")
    try:
        assert httpx.post(serve.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
        httpx.get(serve.url + "/v1/models%0aINFO%20forged", timeout=10)  # the stub's 404: a call all the same
        ready = httpx.get(serve.url + "/ready", timeout=10).text
    finally:
        serve.stop()
    output = serve.stderr()
    assert "call " in output and "***@" in output and "***@" in ready
    assert SECRET not in output and SECRET not in ready
    assert not [line for line in serve.lines if line.startswith("INFO forged")]  # one call, one line


# -- callers learn which leg failed and how, not which server ------------------------------


async def test_error_bodies_say_what_failed_without_naming_servers(stub: StubServer) -> None:
    closed = closed_port_url()
    port = closed.rsplit(":", 1)[1].split("/")[0]
    settings = {"breaker_failures": 1, "prefill_attempts": 1, "decode_attempts": 1, "on_prefill_failure": "fail"}
    with running_proxy(config_for(closed, closed, **settings)) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            first = await http.post("/chat/completions", json=CHAT)
            second = await http.post("/chat/completions", json=CHAT)
            models = await http.get("/models")  # the decode pool's breaker is open too now
            after = await http.get("/models")
    assert (first.status_code, first.headers["x-pd-failed-leg"]) == (502, "prefill")
    assert first.json()["error"]["message"] == "pdclient serve: prefill leg failed: connect error"
    assert (second.status_code, second.headers["x-pd-failed-leg"]) == (503, "prefill")
    assert second.json()["error"]["message"] == (
        "pdclient serve: prefill leg failed: no admitted endpoint (every circuit breaker is open)"
    )
    assert (models.status_code, models.json()["error"]["message"]) == (
        502,
        "pdclient serve: decode leg failed: connect error",
    )
    assert (after.status_code, after.headers["x-pd-failed-leg"]) == (503, "decode")
    assert "no admitted endpoint" in after.json()["error"]["message"]
    for response in (first, second, models, after):
        assert "127.0.0.1" not in response.text and port not in response.text
        assert not [h for h in response.headers if h.startswith("x-pd-") and h != "x-pd-failed-leg"]


async def test_retried_prefill_and_decode_timeout(stub: StubServer) -> None:
    stub.inject(Fault(status=503), leg="prefill", times=1)  # the prefill's own answer, retried
    stub.inject(Fault(delay=2.0), leg="decode")
    with running_proxy(config_for(stub.url, timeout=0.5, on_prefill_failure="fail")) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url, timeout=10) as http:
            response = await http.post("/chat/completions", json=CHAT)
    assert (response.status_code, response.headers["x-pd-failed-leg"]) == (504, "decode")
    assert response.json()["error"]["message"] == "pdclient serve: decode leg failed: timeout"


async def test_prefill_connect_errors_over_attempts(stub: StubServer) -> None:
    with running_proxy(config_for(closed_port_url(), stub.url, on_prefill_failure="fail", breaker_failures=5)) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            response = await http.post("/chat/completions", json=CHAT)
    assert response.json()["error"]["message"] == "pdclient serve: prefill leg failed: connect error, after 3 attempts"


async def test_trace_headers_give_the_details(stub: StubServer) -> None:
    closed = closed_port_url()
    with running_proxy(config_for(stub.url, closed, trace_headers=True)) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            response = await http.post("/chat/completions", json=CHAT)
    message = response.json()["error"]["message"]
    assert response.status_code == 502 and message.startswith("pdclient serve: decode leg failed: connect error (")
    assert closed.split("//")[1].split("/")[0] in message  # the operator asked for the topology


# -- /ready and /metrics may require the API key ------------------------------------------


async def test_status_routes_may_require_the_api_key(stub: StubServer) -> None:
    with running_proxy(config_for(stub.url, api_keys=("k1",), status_requires_api_key=True)) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            refused = await http.get("/metrics")
            assert refused.status_code == 401 and stub.url not in refused.text
            assert (await http.get("/metrics", headers={"authorization": "Bearer k2"})).status_code == 401
            assert (await http.get("/metrics", headers={"authorization": "Bearer k1"})).status_code == 200
            # /ready without the key: the verdict a probe needs, not where the servers are.
            for headers in ({}, {"authorization": "Bearer k2"}):
                bare = await http.get("/ready", headers=headers)
                assert bare.status_code == 200 and bare.json() == {"ready": True, "degraded": False}
                assert stub.url.split("//")[1].split("/")[0] not in bare.text
            full = await http.get("/ready", headers={"authorization": "Bearer k1"})
            assert full.status_code == 200 and full.json()["decode"][0]["url"] == stub.url
            assert (await http.get("/health")).status_code == 200  # liveness names nothing: never asks
    with running_proxy(config_for(stub.url, api_keys=("k1",))) as proxy:  # by default, as before
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            assert (await http.get("/ready")).status_code == (await http.get("/metrics")).status_code == 200


def test_requiring_the_key_on_status_routes_needs_a_key() -> None:
    from pdclient import PDConfigError

    with pytest.raises(PDConfigError, match="status_requires_api_key needs at least one api_key"):
        config_for("http://p:1/v1", status_requires_api_key=True)


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_a_servers_own_error_answer_passes_as_it_came(stub: StubServer, leg: str) -> None:
    """Only pdclient's own error bodies are rewritten: a server's answer is the caller's to read."""
    stub.inject(Fault(status=500), leg=leg, times=5)
    with running_proxy(config_for(stub.url, on_prefill_failure="fail", prefill_attempts=1)) as proxy:
        async with httpx.AsyncClient(base_url=proxy.base_url) as http:
            response = await http.post("/chat/completions", json=CHAT)
    assert (response.status_code, response.headers["x-pd-failed-leg"]) == (500, leg)
    assert response.json()["error"]["message"] == "injected HTTP 500"
