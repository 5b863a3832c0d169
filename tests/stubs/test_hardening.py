"""Issue 13's client items that need real sockets (the rest: tests/mocked/test_hardening.py).

Every test here failed before its fix (item numbers as in the issue).
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
from typing import Any

import httpx
import openai
import pytest

from pdclient import AsyncPDTransport, Outcome, PDOptions, PDTrace, PDTransport, RetrySettings
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
            # A test run started in the background by a shell without job control inherits
            # SIGINT ignored, and so would the script: Python then raises no KeyboardInterrupt.
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
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


# -- an upload that names kv_transfer_params' carrier ------------------------------------------------


async def test_a_refused_upload_is_cut_before_the_server_has_it_whole(mode: str) -> None:
    """The upload streams unread: its file goes out before the form field that names
    ``vllm_xargs``, and the stream stops before that field's bytes, so the server's form
    parser never sees a whole form (and vLLM never runs it)."""
    audio = os.urandom(1 << 20).replace(b"vllm_xargs", b"").replace(b"kv_transfer_params", b"")
    files = [("file", ("a.wav", audio)), ("vllm_xargs", (None, '{"kv\\u005ftransfer_params": []}'))]
    with StubServer() as prefill, StubServer() as decode:
        traces: list[PDTrace] = []
        options = PDOptions(prefill_base_url=prefill.url, decode_base_url=decode.url, on_trace=traces.append)
        transport = PDTransport(options=options) if mode == "sync" else AsyncPDTransport(options=options)
        http: Any = httpx.Client(transport=transport) if mode == "sync" else httpx.AsyncClient(transport=transport)

        async def send(request: httpx.Request) -> httpx.Response:
            return http.send(request) if mode == "sync" else await http.send(request)

        url = f"{decode.url}/audio/transcriptions"
        response = await send(http.build_request("POST", url, data={"model": "w"}, files=files))
        assert response.status_code == 400 and "vllm_xargs" in response.json()["error"]["message"]
        for _ in range(250):  # the stub records the body once its connection closes
            if decode.received:
                break
            await asyncio.sleep(0.02)
        [received] = decode.received
        assert 0 < len(received.raw_body) < int(received.headers["content-length"]), "cut mid-stream"
        assert b"vllm_xargs" not in received.raw_body
        assert [(e.in_flight, e.state) for e in transport.fleet.decode.endpoints] == [(0, "closed")]
        assert traces == [] or traces[0].outcome is Outcome.REFUSED
        # The same upload without that field reaches the server whole.
        whole = http.build_request("POST", f"{decode.url}/files", data={"purpose": "batch"}, files=files[:1])
        answered = await send(whole)
        assert answered.json()["bytes"] == int(whole.headers["content-length"])
        await (http.aclose() if mode == "async" else asyncio.to_thread(http.close))
