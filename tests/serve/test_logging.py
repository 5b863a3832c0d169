"""One log line per call: its fields in-process, and as JSON lines from a real process."""

from __future__ import annotations

import json
import logging
import logging.config

import httpx
import pytest

from pdclient.conversations import Reason
from pdclient.serve._logging import CALL_FIELDS, JSONFormatter, logging_config
from tests.stubserver import StubServer

from .conftest import MESSAGES, PROMPT_TOKENS, RunningProxy, ServeProcess

CHAT = {"model": "m", "messages": MESSAGES}


async def test_one_info_line_per_call(proxy: RunningProxy, stub: StubServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="pdclient.serve")
    async with httpx.AsyncClient(base_url=proxy.base_url) as http:
        await http.post("/chat/completions", json={**CHAT, "stream": True}, headers={"x-request-id": "req-1"})
        await http.get("/models", headers={"x-request-id": "req-2"})
    lines = [r for r in caplog.records if r.name == "pdclient.serve" and hasattr(r, CALL_FIELDS)]
    assert [r.levelno for r in lines] == [logging.INFO, logging.INFO]
    chat, models = (getattr(r, CALL_FIELDS) for r in lines)
    assert chat["request_id"] == "req-1" and chat["route"] == "chat" and chat["outcome"] == "disaggregated"
    assert chat["leg_request_id"] == stub.legs("decode")[0].headers["x-request-id"] != "req-1"
    assert chat["prefill_url"] == chat["decode_url"] == stub.url
    assert chat["forwarded_tokens"] == PROMPT_TOKENS and chat["decode_status"] == 200
    # Why it went P/D, and how: what an operator reads a slow call's line for.
    assert chat["remote_prefill_reason"] in {r.value for r in Reason} and chat["dispatch"] == "sequential"
    for name in ("prefill_ms", "decode_headers_ms", "decode_first_byte_ms", "ttft_ms", "total_ms"):
        assert chat[name] > 0, name
    assert models["request_id"] == "req-2" and models["outcome"] == "passthrough" and models["path"] == "/v1/models"
    assert "request_id=req-1" in lines[0].getMessage() and "outcome=disaggregated" in lines[0].getMessage()


def test_json_formatter() -> None:
    record = logging.LogRecord("pdclient.serve", logging.INFO, __file__, 1, "call %s", ("x",), None)
    setattr(record, CALL_FIELDS, {"request_id": "r", "prefill_ms": 1.5, "fallback": None})
    entry = json.loads(JSONFormatter().format(record))
    assert entry["message"] == "call" and entry["request_id"] == "r" and entry["prefill_ms"] == 1.5
    assert "fallback" not in entry and entry["level"] == "INFO" and entry["logger"] == "pdclient.serve"
    plain = logging.LogRecord("uvicorn.error", logging.INFO, __file__, 1, "Started %s", ("it",), None)
    assert json.loads(JSONFormatter().format(plain))["message"] == "Started it"


def test_log_format_json_process() -> None:
    with StubServer() as stub:
        serve = ServeProcess("--prefill", stub.url, "--decode", stub.url, "--log-format", "json")
        try:
            assert httpx.post(serve.url + "/v1/chat/completions", json=CHAT, timeout=10).status_code == 200
        finally:
            serve.stop()
    entries = [json.loads(line) for line in serve.lines if line.strip()]  # every line is JSON, uvicorn's too
    (call,) = [e for e in entries if e["message"] == "call"]
    assert call["outcome"] == "disaggregated" and call["decode_url"] == stub.url and "total_ms" in call


def proxy_formatters() -> tuple[logging.Formatter, logging.Formatter]:
    """The text and JSON formatters ``pdclient serve`` logs with, made as its logging config says."""
    formatters = [logging_config(kind, "info")["formatters"]["default"] for kind in ("text", "json")]
    text, as_json = (logging.config.DictConfigurator({}).configure_formatter(dict(f)) for f in formatters)
    return text, as_json


async def test_a_caller_cannot_forge_a_log_line(
    proxy: RunningProxy, stub: StubServer, caplog: pytest.LogCaptureFixture
) -> None:
    """The path is logged decoded: its control characters are escaped, and a value with
    spaces is quoted, so neither a line nor a key=value can be faked."""
    caplog.set_level(logging.INFO, logger="pdclient.serve")
    forged = "/models%0d%0a2030-01-01 INFO pdclient.serve [1]: call outcome=disaggregated%1b[2J%e2%80%a8x"
    async with httpx.AsyncClient(base_url=proxy.base_url) as http:
        await http.get(forged, headers={"x-request-id": "req-1 outcome=disaggregated"})
    (record,) = [r for r in caplog.records if hasattr(r, CALL_FIELDS)]
    text, as_json = (f.format(record) for f in proxy_formatters())
    for line in (text, as_json):
        assert not {"\n", "\r", "\x1b", "\u2028"} & set(line), line
    assert (
        ' path="/v1/models\\r\\n2030-01-01 INFO pdclient.serve [1]: call outcome=disaggregated\\x1b[2J\\u2028x" '
        in text
    )
    assert 'request_id="req-1 outcome=disaggregated"' in text and " outcome=passthrough " in text
    assert json.loads(as_json)["path"].startswith("/v1/models\\r\\n2030")


def test_every_logged_message_is_one_line() -> None:
    text, as_json = proxy_formatters()
    record = logging.LogRecord("pdclient.serve", logging.WARNING, __file__, 1, "request %s: %s", ("a\nb", "\x00"), None)
    assert text.format(record).endswith("request a\\nb: \\x00")
    assert json.loads(as_json.format(record))["message"] == "request a\\nb: \\x00"
    assert record.getMessage() == "request a\nb: \x00"  # the record itself, as other handlers get it


def test_time_stamps_are_those_of_logging_formatter() -> None:
    """Within a second and across seconds, with and without milliseconds: the proxy's
    formatters stamp each line as the standard library's would."""
    text, as_json = proxy_formatters()
    fmt = "%(asctime)s %(levelname)s %(name)s [%(process)d]: %(message)s"
    standard = logging.Formatter(fmt)
    for created in (1_700_000_000.125, 1_700_000_000.875, 1_700_000_001.5, 1_700_000_000.25, 1_800_000_000.0):
        record = logging.LogRecord("pdclient.serve", logging.INFO, __file__, 1, "call %s", ("x",), None)
        record.created, record.msecs = created, (created - int(created)) * 1000
        assert text.format(record) == standard.format(record)
        expected = standard.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}"
        assert json.loads(as_json.format(record))["time"] == expected
