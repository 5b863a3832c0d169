"""Concurrent dispatch on a real pair in vLLM's push mode (``NixlPushConnector``).

One push-mode pair of its own, started once for this module (the tier's shared pair runs
pull mode). The answers are compared with the sequential handoff's on the same pair, the
KV transfer is read from the decode's ``/metrics``, and after normal, failed and
abandoned calls both servers' KV cache usage must come back to idle. The failed prefill
runs last: vLLM 0.32 keeps its cut decode's blocks (``decode_kv_released``).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdclient import AsyncPDChatClient, PDChatClient, PDOptions, PDTrace, PDTransport
from pdclient.local import LocalPD

from .helpers import metric

KV_USAGE = "vllm:kv_cache_usage_perc"
EXTERNAL = ("vllm:prompt_tokens_by_source_total{", 'source="external_kv_transfer"')
# A prompt long enough for several KV blocks, its own per test (no prefix-cache hits across tests).
FILLER = " ".join(f"item {i} is a {('red', 'green', 'blue')[i % 3]} box;" for i in range(60))


def messages(tag: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"[{tag}] {FILLER} Which colour is item 7? Answer in one word."}]


def external_tokens(url: str) -> float:
    root = url.removesuffix("/v1")
    text = httpx.get(f"{root}/metrics", timeout=10).text
    name, label = EXTERNAL  # vLLM writes the labels in its own order
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name) and label in line)


def wait_idle(url: str, seconds: float = 30.0) -> float:
    deadline = time.monotonic() + seconds
    usage = metric(url, KV_USAGE)
    while usage > 0 and time.monotonic() < deadline:
        time.sleep(0.25)
        usage = metric(url, KV_USAGE)
    return usage


def decode_kv_released(pd: LocalPD) -> None:
    """The decode server freed the blocks of the decode pdclient cancelled (closed its connection).

    Seen on vLLM 0.32 (CPU pair): it does not, for a decode whose registration went out.
    The abort of a request in ``WAITING_FOR_REMOTE_KVS`` holds its blocks until the worker
    reports ``finished_recving`` (``Scheduler.finish_requests``: a WRITE still landing must
    not corrupt the blocks' next owner); in push mode only the prefill server's WRITE
    completion produces that, the receiving side has no lease, and ``request_finished``
    drops the registration's watchdog. A prefill that never WRITEs (it failed, or was
    cancelled with the call) leaves the blocks held until the server restarts: vLLM issue
    #46283, open. Recorded as an expected failure of vLLM's, not of the client.
    """
    if wait_idle(pd.decode_url, 30) > 0:
        pytest.xfail("vLLM 0.32 push mode keeps an aborted, registered decode's KV blocks (vLLM #46283)")


@pytest.fixture(scope="module")
def push() -> Iterator[LocalPD]:
    if os.environ.get("PDCLIENT_E2E_PAIR"):
        pytest.skip("PDCLIENT_E2E_PAIR attaches to a pull-mode pair; this test starts a push-mode one")
    with LocalPD(kv_connector="nixl-push") as pd:
        yield pd


def learnt(pd: LocalPD, **kwargs: Any) -> PDChatClient:
    """A client that has seen one prefill answer: its next calls may go concurrent."""
    # remote_prefill "always": a repeated prompt stays a handoff (not decode-only by conversation memory).
    client = pd.client(dispatch="auto", remote_prefill="always", max_retries=0, **kwargs)
    client.chat.completions.create(model=pd.model, messages=messages("learn"), max_tokens=1, temperature=0)
    return client


def test_concurrent_answer_is_the_sequential_one_and_the_kv_moved(push: LocalPD) -> None:
    traces: list[PDTrace] = []
    client = learnt(push, on_trace=traces.append)
    sequential = client.with_options(dispatch="sequential")
    before = external_tokens(push.decode_url)
    reference = sequential.chat.completions.create(
        model=push.model, messages=messages("a"), max_tokens=12, temperature=0
    )
    answer = client.chat.completions.create(model=push.model, messages=messages("b"), max_tokens=12, temperature=0)
    # "a" again, streamed: the decode's prefix cache holds its prompt from the sequential call,
    # so it allocates (and the prefill server WRITEs) only the blocks it lacks.
    hits = metric(push.decode_url, "vllm:prefix_cache_hits_total")
    stream = client.chat.completions.create(
        model=push.model, messages=messages("a"), max_tokens=12, temperature=0, stream=True
    )
    again = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert metric(push.decode_url, "vllm:prefix_cache_hits_total") - hits >= 256
    assert [t.dispatch for t in traces[-3:]] == ["sequential", "concurrent", "concurrent"]
    # Each concurrent decode's prompt ids, read from its first event, equal the prefill's: no fallback.
    assert all(t.fallback is None for t in traces[-3:]), [t.fallback for t in traces[-3:]]
    assert again == reference.choices[0].message.content
    assert answer.usage is not None and answer.usage.prompt_tokens > 400
    # The concurrent decode took the prompt over the KV transfer (all but the last block at most).
    moved = external_tokens(push.decode_url) - before
    assert moved >= answer.usage.prompt_tokens - 128, moved
    assert wait_idle(push.prefill_url) == 0 and wait_idle(push.decode_url) == 0
    client.close()


class EditThePrefill(httpx.BaseTransport):
    """Leg transport: prefills are sent with "item 7" read as "item 8", a prompt of the same
    length in tokens: what a prefill server with another chat template renders."""

    def __init__(self, prefill_url: str) -> None:
        self.inner = httpx.HTTPTransport()
        self.prefill_url = prefill_url

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if str(request.url).startswith(self.prefill_url):
            body = request.read().replace(b"item 7?", b"item 8?")
            headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
            request = httpx.Request(request.method, request.url, headers=headers, content=body)
        return self.inner.handle_request(request)


def test_a_drifted_prompt_is_cut_before_the_caller_reads_it(push: LocalPD) -> None:
    """The decode renders the caller's prompt, the prefill another of the same length: the
    WRITE fits the decode's blocks, and the answer it would give comes from a KV that is not
    its prompt's. pdclient reads the decode's first event, sees the ids differ, cuts it, and
    has the decode compute the prefill's ids; that prefill server's next call is sequential."""
    traces: list[PDTrace] = []
    options = PDOptions(
        push.prefill_urls, push.decode_urls, dispatch="auto", remote_prefill="always", on_trace=traces.append
    )
    http = httpx.Client(transport=PDTransport(options=options, leg_transport=EditThePrefill(push.prefill_url)))
    client = openai.OpenAI(base_url=push.decode_url, api_key="EMPTY", max_retries=0, http_client=http)

    def ask(tag: str) -> str | None:
        """How the streamed answer ended (its finish reason): it came whole, whatever it says."""
        stream = client.chat.completions.create(
            model=push.model, messages=messages(tag), max_tokens=12, temperature=0, stream=True
        )
        return [c.choices[0].finish_reason for c in stream if c.choices][-1]

    reference = ask("e")  # sequential: the decode takes the prefill's ids, so answers the edited prompt
    checked = ask("f")
    after = ask("g")
    assert [t.dispatch for t in traces] == ["sequential", "sequential", "sequential"]
    assert traces[1].fallback is not None and "rendered another prompt" in traces[1].fallback, traces[1].fallback
    assert [t.dispatch_fallback for t in traces] == [None, "prompt_drift", None]
    assert traces[2].fallback is None
    assert {reference, checked, after} <= {"stop", "length"}
    assert wait_idle(push.prefill_url) == 0 and wait_idle(push.decode_url) == 0
    client.close()


def test_abandoned_call_frees_both_servers(push: LocalPD) -> None:
    async def abandon() -> PDTrace:
        traces: list[PDTrace] = []
        client = AsyncPDChatClient(
            prefill_base_url=push.prefill_urls, decode_base_url=push.decode_urls, api_key="EMPTY",
            dispatch="auto", max_retries=0, on_trace=traces.append,
        )  # fmt: skip
        await client.chat.completions.create(model=push.model, messages=messages("learn2"), max_tokens=1)
        call = asyncio.ensure_future(
            client.chat.completions.create(model=push.model, messages=messages("d"), max_tokens=64, temperature=0)
        )
        await asyncio.sleep(0.3)  # both legs sent, the prefill computing
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await client.close()
        return traces[-1]

    trace = asyncio.run(abandon())
    assert trace.dispatch == "concurrent"
    # The prefill was read to its end (the client's close waited for it): its WRITE freed the
    # cut decode's blocks, and the prefill server freed its own after the WRITE.
    assert wait_idle(push.prefill_url) == 0
    assert wait_idle(push.decode_url) == 0


class FailThePrefill(httpx.BaseTransport):
    """Leg transport: once armed, prefills answer 503 after a moment (the decode has registered by then)."""

    def __init__(self, prefill_url: str) -> None:
        self.inner = httpx.HTTPTransport()
        self.prefill_url = prefill_url
        self.armed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        if self.armed and str(request.url).startswith(self.prefill_url):
            time.sleep(1.0)
            return httpx.Response(503, json={"error": {"message": "prefill down"}})
        return self.inner.handle_request(request)


def test_failed_prefill_aborts_the_registered_decode(push: LocalPD) -> None:
    traces: list[PDTrace] = []
    legs = FailThePrefill(push.prefill_url)
    options = PDOptions(
        push.prefill_urls,
        push.decode_urls,
        dispatch="auto",
        remote_prefill="always",
        on_prefill_failure="fail",
        on_trace=traces.append,
    )
    http = httpx.Client(transport=PDTransport(options=options, leg_transport=legs))
    client = openai.OpenAI(base_url=push.decode_url, api_key="EMPTY", max_retries=0, http_client=http)
    client.chat.completions.create(model=push.model, messages=messages("learn3"), max_tokens=1, temperature=0)
    legs.armed = True
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model=push.model, messages=messages("c"), max_tokens=12, temperature=0)
    assert time.monotonic() - started < 20
    assert traces[-1].dispatch == "concurrent" and traces[-1].failed_leg == "prefill"
    assert wait_idle(push.prefill_url, 15) == 0  # no prefill ran
    client.close()
    decode_kv_released(push)
