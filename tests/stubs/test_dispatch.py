"""Concurrent dispatch over real sockets (the loopback stub in push mode): a decode in flight
is cut when its prefill fails, and both legs end when the caller leaves; sync and async."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import anyio
import openai
import prometheus_client
import pytest

from pdclient import PDTrace
from pdclient.metrics import PrometheusObserver
from pdclient.pools import RetrySettings
from tests import fake_vllm
from tests.stubs.conftest import push_stubs
from tests.stubserver import Fault, StubServer
from tests.twins import Twin

MESSAGES: Any = [{"role": "user", "content": "Say hello."}]
FAST = RetrySettings(backoff_initial=0.001, backoff_max=0.01)
HELD = 20.0
"""How long the decode stub holds its answer: a decode waiting for a KV WRITE that never comes."""
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[StubServer, StubServer]]:
    with push_stubs() as (prefill, decode):
        yield prefill, decode


@pytest.fixture
def pair(servers: tuple[StubServer, StubServer]) -> tuple[StubServer, StubServer]:
    for server in servers:
        server.clear()
    return servers


def _twin(mode: str, pair: tuple[StubServer, StubServer], traces: list[PDTrace], **kwargs: Any) -> Twin:
    prefill, decode = pair
    return Twin(
        mode,
        prefill_base_url=prefill.url,
        decode_base_url=decode.url,
        retries=FAST,
        dispatch="auto",
        on_trace=traces.append,
        **kwargs,
    )


async def test_failed_prefill_cuts_the_waiting_decode(mode: str, pair: tuple[StubServer, StubServer]) -> None:
    prefill, decode = pair
    traces: list[PDTrace] = []
    twin = _twin(mode, pair, traces, on_prefill_failure="fail")
    await twin.chat(messages=MESSAGES, max_tokens=4)  # learns the coordinates
    prefill.inject(Fault(status=500), leg="prefill", times=3)
    decode.inject(Fault(delay=HELD), leg="decode")
    started = time.monotonic()
    with pytest.raises(openai.InternalServerError):
        await twin.chat(messages=MESSAGES, max_tokens=4)
    # Not the decode's 20 s, nor the 10 s a cut that failed would wait for its thread.
    assert time.monotonic() - started < 5.0
    assert traces[-1].dispatch == "concurrent" and traces[-1].failed_leg == "prefill"
    assert len(decode.legs("decode")) == 2
    await twin.close()


async def test_concurrent_answer_is_the_sequential_one(mode: str, pair: tuple[StubServer, StubServer]) -> None:
    _, decode = pair
    traces: list[PDTrace] = []
    twin = _twin(mode, pair, traces)
    sequential = await twin.stream_text(messages=MESSAGES, max_tokens=16)
    concurrent = await twin.stream_text(messages=MESSAGES, max_tokens=16)
    # The concurrent decode asks for token ids (its prompt's are checked): the stub then sends
    # one chunk per token, so the pieces differ; the text does not.
    assert "".join(concurrent) == "".join(sequential)
    assert [t.dispatch for t in traces] == ["sequential", "concurrent"]
    assert traces[1].fallback is None
    first, second = decode.legs("decode")
    assert first.forwarded_ids and second.forwarded_ids is None  # the concurrent decode renders the prompt itself
    assert second.body["return_token_ids"] is True
    assert second.headers["x-request-id"] == traces[1].leg_request_id
    await twin.close()


async def test_drifted_prompt_is_never_the_answer(mode: str) -> None:
    """A decode that renders another prompt than the prefill (another chat template, the same
    length) never answers the caller: it is cut before its first byte reaches the caller, the
    decode is sent again with the prefill's ids to compute itself, and that prefill server
    gets sequential handoffs from then on."""
    with push_stubs() as (prefill, decode):
        rendered = decode.prompt_ids

        def drifted(body: dict[str, Any]) -> list[int]:
            ids = rendered(body)
            return [*ids[:10], ids[10] + 1, *ids[11:]]

        decode.prompt_ids = drifted  # type: ignore[method-assign]
        traces: list[PDTrace] = []
        registry = prometheus_client.CollectorRegistry()
        twin = _twin(mode, (prefill, decode), traces, observers=[PrometheusObserver(registry)])
        sequential = await twin.stream_text(messages=MESSAGES, max_tokens=16)
        checked = await twin.stream_text(messages=MESSAGES, max_tokens=16)
        after = await twin.stream_text(messages=MESSAGES, max_tokens=16)
        assert "".join(checked) == "".join(sequential) == "".join(after)
        assert [t.dispatch for t in traces] == ["sequential", "sequential", "sequential"]
        assert traces[1].fallback is not None and "rendered another prompt" in traces[1].fallback
        assert "64 tokens against 64, first at token 10" in traces[1].fallback
        assert [t.dispatch_fallback for t in traces] == [None, "prompt_drift", None]
        assert traces[2].fallback is None
        count = registry.get_sample_value
        assert count("pdclient_dispatch_total", {"route": "chat", "dispatch": "sequential", "fallback": ""}) == 2
        assert (
            count("pdclient_dispatch_total", {"route": "chat", "dispatch": "sequential", "fallback": "prompt_drift"})
            == 1
        )
        legs = decode.legs("decode")
        assert len(legs) == 4  # sequential; concurrent, cut; its replacement; sequential
        cut, again = legs[1], legs[2]
        assert cut.forwarded_ids is None and cut.body["kv_transfer_params"]["do_remote_prefill"] is True
        # The prefill's KV went into the cut decode's blocks: the new one computes the prefill's ids.
        prefill_ids = prefill.prompt_ids(prefill.legs("prefill")[1].body)
        assert again.body["kv_transfer_params"] == {"prompt_token_ids": prefill_ids}
        await twin.close()


async def test_caller_leaving_ends_both_legs() -> None:
    with push_stubs() as (prefill, decode):
        traces: list[PDTrace] = []
        twin = _twin("async", (prefill, decode), traces)
        await twin.chat(messages=MESSAGES, max_tokens=4)
        prefill.inject(Fault(delay=2.0), leg="prefill")  # read to its end after the caller left
        decode.inject(Fault(delay=HELD), leg="decode")
        started = time.monotonic()
        with anyio.move_on_after(0.5):
            await twin.chat(messages=MESSAGES, max_tokens=4)
        assert time.monotonic() - started < 1.5
        assert traces[-1].dispatch == "concurrent" and traces[-1].outcome.value == "failed"
        await twin.close()


async def test_a_copy_s_caller_leaving_ends_both_legs_as_the_original_s() -> None:
    """A ``with_options`` copy with other P/D options runs concurrent calls as its original
    does: a caller that leaves cuts the decode and returns at once, the prefill is read to
    its end meanwhile, and closing either client (they share the connections) waits for it."""
    with push_stubs() as (prefill, decode):
        traces: list[PDTrace] = []
        twin = _twin("async", (prefill, decode), traces)
        copy = twin.client.with_options(dispatch="concurrent")
        await twin.chat(copy, messages=MESSAGES, max_tokens=4)
        prefill.inject(Fault(delay=2.0), leg="prefill")
        decode.inject(Fault(hold=HELD), leg="decode")
        started = time.monotonic()
        with anyio.move_on_after(0.5):
            await twin.chat(copy, messages=MESSAGES, max_tokens=4)
        assert time.monotonic() - started < 1.5
        assert traces[-1].dispatch == "concurrent" and traces[-1].outcome.value == "failed"
        await twin.close()  # the original: it closes the connections the copy's prefill is on
        assert time.monotonic() - started > 1.5, "the close waited for the prefill's answer"
        assert [(s.events_sent, s.how) for s in decode.streams] == [(0, "client closed")]
        await twin.call(copy.close)


_CTRL_C = """
import asyncio, os, signal, sys, threading
from pdclient import {client}, PDObserver

prefill, decode = sys.argv[1], sys.argv[2]


class CtrlCAfterThePrefill(PDObserver):
    # Ctrl-C once the second (concurrent) call's prefill answered: its decode waits for headers.
    prefills = 0

    def on_leg_end(self, call, leg, status, error):
        if leg.name == "prefill":
            self.prefills += 1
            if self.prefills == 2:
                threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()


client = {client}(
    prefill_base_url=prefill, decode_base_url=decode, dispatch="auto", observers=[CtrlCAfterThePrefill()],
    api_key="k", max_retries=0,
)


{defn} calls():
    for _ in range(2):
        {await_}client.chat.completions.create(model="m", messages=[{{"role": "user", "content": "hi"}}])


try:
    {run}
except KeyboardInterrupt:
    print("interrupted", flush=True)
sys.stdin.read()  # alive until the test has looked: the decode's connection is not closed by the exit
"""


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_ctrl_c_while_the_decode_waits_cuts_it(mode: str, pair: tuple[StubServer, StubServer]) -> None:
    """A KeyboardInterrupt after the prefill answered and before the concurrent decode's
    headers came cuts the decode's connection (the decode server then aborts it), as it does
    in sequential mode, instead of leaving it to generate its answer for nobody."""
    prefill, decode = pair
    sync = mode == "sync"
    script = _CTRL_C.format(
        client="PDChatClient" if sync else "AsyncPDChatClient",
        defn="def" if sync else "async def",
        await_="" if sync else "await ",
        run="calls()" if sync else "asyncio.run(calls())",
    )
    decode.inject(Fault(), leg="decode")  # the first call's (sequential) decode answers at once
    decode.inject(Fault(hold=HELD), leg="decode")
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(script), prefill.url, decode.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": REPO},
        # A test run in the background by a shell without job control inherits SIGINT
        # ignored, and so would the script: Python then raises no KeyboardInterrupt.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        assert child.stdout is not None
        line = child.stdout.readline()  # a hang guard: the held decode's 20 s, then the call ends
        assert line == "interrupted\n", child.stderr.read() if child.stderr else ""
        deadline = time.monotonic() + 5.0
        while not decode.streams and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [(s.events_sent, s.how) for s in decode.streams] == [(0, "client closed")], "the decode is cut"
        assert [leg.forwarded_ids for leg in decode.legs("decode")] == [64, None]  # sequential, then concurrent
    finally:
        child.communicate(timeout=60)


async def test_a_decode_without_prompt_ids_is_not_trusted(
    mode: str, pair: tuple[StubServer, StubServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode whose first event has no prompt ids (something on the way drops
    ``return_token_ids``) cannot be checked: it is cut and sent again like a drifted one, and
    that prefill server gets sequential handoffs from then on, not a cut decode per call."""
    monkeypatch.setattr(fake_vllm, "wants_ids", lambda body: False)
    traces: list[PDTrace] = []
    twin = _twin(mode, pair, traces)
    answers = [await twin.stream_text(messages=MESSAGES, max_tokens=16) for _ in range(3)]
    assert all("".join(answer) == "".join(answers[0]) for answer in answers)
    assert [t.dispatch_fallback for t in traces] == [None, "prompt_unchecked", None]
    assert [t.dispatch for t in traces] == ["sequential"] * 3
    assert len(pair[1].legs("decode")) == 4
    await twin.close()
