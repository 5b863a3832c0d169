"""Issue 13's client items that need real sockets (the rest: tests/mocked/test_hardening.py).

Every test here failed before its fix (item numbers as in the issue).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from typing import Any

import openai
import pytest

from pdclient import Outcome, PDTrace, RetrySettings
from tests.stubserver import Fault, StubServer, forward_proxy
from tests.twins import Twin

MESSAGES = [{"role": "user", "content": "Is it up?"}]
FAST = RetrySettings(backoff_initial=0.001, backoff_max=0.01)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def traced(mode: str, **kwargs: Any) -> tuple[Twin, list[PDTrace]]:
    traces: list[PDTrace] = []
    kwargs.setdefault("retries", FAST)
    return Twin(mode, on_trace=traces.append, **kwargs), traces


# -- 9: [DONE], then a dropped connection -----------------------------------------------------------


async def test_9_on_real_sockets(mode: str) -> None:
    with StubServer() as prefill, StubServer() as decode:
        decode.inject(Fault(drop_after_done=True), leg="decode")
        twin, traces = traced(mode, prefill_base_url=prefill.url, decode_base_url=decode.url)
        text = "".join(await twin.stream_text(messages=MESSAGES, max_tokens=8))
        assert text and traces[0].outcome is Outcome.DISAGGREGATED
        await twin.close()


# -- 11: the KV release on Ctrl-C ------------------------------------------------------------------

_CTRL_C = """
import asyncio, os, signal, sys, threading, time
import httpx
from pdclient import {client}, PDOptions, {transport}

prefill, decode = sys.argv[1], sys.argv[2]


class Hold({base}):
    # Sends the prefill, holds the decode (before a byte of it goes out) until Ctrl-C.
    def __init__(self):
        self.inner = {inner}()

    {defn} {handle}(self, request):
        if request.url.path.endswith("/chat/completions") and b'"max_tokens":1,' not in request.content:
            threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()
            {sleep}
        return {await_}self.inner.{handle}(request)


transport = {transport}(options=PDOptions(prefill, decode), leg_transport=Hold())
client = {client}(http_client={http}(transport=transport), api_key="k", max_retries=0)
{call}
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_11_ctrl_c_between_the_legs_sends_the_release_before_exiting(mode: str) -> None:
    sync = mode == "sync"
    script = _CTRL_C.format(
        client="PDChatClient" if sync else "AsyncPDChatClient",
        transport="PDTransport" if sync else "AsyncPDTransport",
        base="httpx.BaseTransport" if sync else "httpx.AsyncBaseTransport",
        inner="httpx.HTTPTransport" if sync else "httpx.AsyncHTTPTransport",
        defn="def" if sync else "async def",
        handle="handle_request" if sync else "handle_async_request",
        sleep="time.sleep(60)" if sync else "await asyncio.sleep(60)",
        await_="" if sync else "await ",
        http="httpx.Client" if sync else "httpx.AsyncClient",
        call='client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])'
        if sync
        else 'asyncio.run(client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}]))',
    )
    with StubServer() as prefill, StubServer() as decode:
        run = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script), prefill.url, decode.url],
            capture_output=True,
            text=True,
            timeout=180,  # a hang guard only: a starved machine takes seconds to import openai
            env={**os.environ, "PYTHONPATH": REPO},
        )
        assert run.returncode != 0 and "KeyboardInterrupt" in run.stderr, run.stderr[-2000:]
        releases = decode.legs("decode")
        assert len(releases) == 1, "the release reached the decode server before the process ended"
        assert releases[0].body["max_tokens"] == 1 and releases[0].forwarded_ids


# -- 12: no second pull when the decode request may have reached its server -------------------------


async def test_12_decode_timeout_after_sending_is_not_released(mode: str) -> None:
    with StubServer() as prefill, StubServer() as decode:
        decode.inject(Fault(delay=5.0), leg="decode")
        twin, traces = traced(mode, prefill_base_url=prefill.url, decode_base_url=decode.url)
        with pytest.raises(openai.APITimeoutError):
            await twin.chat(messages=MESSAGES, timeout=1.0)
        await asyncio.sleep(0.3)
        assert len(decode.legs("decode")) == 1, "one decode pull only: the release was not sent"
        assert traces[0].outcome is Outcome.FAILED
        await twin.close()


# -- 16: HTTP(S)_PROXY ---------------------------------------------------------------------------


async def test_16_legs_honour_http_proxy(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with forward_proxy(monkeypatch) as seen:
        twin = Twin(mode, prefill_base_url="http://prefill.invalid/v1", decode_base_url="http://decode.invalid/v1")
        completion = await twin.chat(messages=MESSAGES)
        assert completion.choices[0].message.content == "via proxy"
        assert seen == [
            "http://prefill.invalid/v1/chat/completions",
            "http://decode.invalid/v1/chat/completions",
        ]
        await twin.close()
