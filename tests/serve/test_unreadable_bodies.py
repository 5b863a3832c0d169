"""``pdclient serve`` answers a body it cannot read or write back (a number beyond a double's
range, JSON nested deeper than orjson writes) with a 400 naming the field, on every route,
and logs no traceback (the cases: tests/mocked/test_call_guards.py)."""

from __future__ import annotations

import httpx

from tests.mocked.test_call_guards import UNREADABLE
from tests.serve.conftest import ServeProcess
from tests.stubserver import StubServer


def test_serve_refuses_json_it_cannot_read_or_write_back_naming_the_field() -> None:
    with StubServer() as stub:
        serve = ServeProcess("--prefill", stub.url, "--decode", stub.url)
        try:
            for route, content, field, why in UNREADABLE:
                response = httpx.post(
                    f"{serve.url}/v1/{route}", content=content, headers={"content-type": "application/json"}, timeout=10
                )
                assert response.status_code == 400, (route, response.text)
                message = response.json()["error"]["message"]
                assert field in message and why in message, (route, message)
            assert stub.received == []
        finally:
            serve.stop()
    log = serve.stderr()
    assert "Traceback" not in log and log.count("outcome=refused") >= len(UNREADABLE) - 1, log
