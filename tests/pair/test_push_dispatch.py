"""Concurrent dispatch on a real pair in vLLM's push mode (``NixlPushConnector``).

One push-mode pair of its own, started once for this module (the tier's shared pair runs
pull mode). The answers are compared with the sequential handoff's on the same pair, the
KV transfer is read from the decode's ``/metrics``, and after normal, failed and
abandoned calls both servers' KV cache usage must come back to idle. The failed prefills
run last: vLLM 0.32 keeps a cut decode's blocks until a WRITE comes, and after a prefill
that failed for good only server_patch's reclaim (``PDCLIENT_PUSH_RECLAIM_GRACE_S``, set by
LocalPD) frees them, the lease plus the grace after the cut; this pair runs a 30 s lease
(LocalPD's is 120 s) so that wait fits a test. The prefill server is killed last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdclient import AsyncPDChatClient, PDChatClient, PDOptions, PDTrace, PDTransport
from pdclient.local import LocalPD
from pdclient.local._server import NIXL_PUSH_KV_TRANSFER_CONFIG
from pdclient.transport import LEG_LIMITS

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


LEASE_S = 30
"""This pair's ``kv_lease_duration``: how long a prefill server keeps a finished prefill's
blocks for the decode's registration."""
GRACE_S = 10.0
"""LocalPD's ``PDCLIENT_PUSH_RECLAIM_GRACE_S``: the reclaim comes this long after the lease."""


def reclaimed(url: str, since: float) -> float:
    """Seconds from ``since`` (the decode's cut) until the server is idle again: no request
    running or waiting, KV usage back to 0. Fails if that takes more than the lease plus
    the grace (and a margin for a loaded host), or comes before the lease has passed (a
    reclaim then could free blocks a WRITE still lands in)."""
    limit = since + LEASE_S + GRACE_S + 15
    while time.monotonic() < limit:
        busy = metric(url, KV_USAGE), metric(url, "vllm:num_requests_running"), metric(url, "vllm:num_requests_waiting")
        if busy == (0, 0, 0):
            took = time.monotonic() - since
            print(f"\n{url}: idle {took:.1f} s after the decode's cut (lease {LEASE_S} s + grace {GRACE_S:g} s)")
            assert took >= LEASE_S - 1, took
            return took
        time.sleep(0.5)
    pytest.fail(f"{url} still busy (KV usage, running, waiting: {busy}) {LEASE_S + GRACE_S + 15:g} s after the cut")


@pytest.fixture(scope="module")
def push() -> Iterator[LocalPD]:
    if os.environ.get("PDCLIENT_E2E_PAIR"):
        pytest.skip("PDCLIENT_E2E_PAIR attaches to a pull-mode pair; this test starts a push-mode one")
    transfer = dict(NIXL_PUSH_KV_TRANSFER_CONFIG)
    transfer["kv_connector_extra_config"] = {**transfer["kv_connector_extra_config"], "kv_lease_duration": LEASE_S}
    # vLLM takes the last --kv-transfer-config: LocalPD's, with a shorter lease.
    with LocalPD(kv_connector="nixl-push", extra_server_args=["--kv-transfer-config", json.dumps(transfer)]) as pd:
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
    # Asked for: auto's own choice takes turns between the modes while it learns them.
    concurrent = client.with_options(dispatch="concurrent")
    before = external_tokens(push.decode_url)
    reference = sequential.chat.completions.create(
        model=push.model, messages=messages("a"), max_tokens=12, temperature=0
    )
    answer = concurrent.chat.completions.create(model=push.model, messages=messages("b"), max_tokens=12, temperature=0)
    # "a" again, streamed: the decode's prefix cache holds its prompt from the sequential call,
    # so it allocates (and the prefill server WRITEs) only the blocks it lacks.
    hits = metric(push.decode_url, "vllm:prefix_cache_hits_total")
    stream = concurrent.chat.completions.create(
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
        self.inner = httpx.HTTPTransport(limits=LEG_LIMITS)  # idle connections dropped before vLLM drops them
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
        self.inner = httpx.HTTPTransport(limits=LEG_LIMITS)  # idle connections dropped before vLLM drops them
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
    cut = time.monotonic()
    assert cut - started < 20
    assert traces[-1].dispatch == "concurrent" and traces[-1].failed_leg == "prefill"
    assert wait_idle(push.prefill_url, 15) == 0  # no prefill ran
    client.close()
    # No WRITE comes for the cut decode: its blocks come back by server_patch's reclaim.
    reclaimed(push.decode_url, cut)


def test_a_decode_whose_prefill_server_died_is_reclaimed(push: LocalPD) -> None:
    """The prefill server is SIGKILLed after the decode registered with it: the prefill fails
    for good, pdclient cuts the decode, and the decode server is idle again within the
    lease plus the grace. Last: the pair has no prefill server after it."""
    assert push.prefill is not None and push.prefill.pid is not None
    pid = push.prefill.pid

    class KillThePrefillServer(httpx.BaseTransport):
        def __init__(self) -> None:
            self.inner = httpx.HTTPTransport(limits=LEG_LIMITS)  # idle connections dropped before vLLM drops them
            self.armed = False

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            if self.armed and str(request.url).startswith(push.prefill_url):
                time.sleep(1.0)  # the decode, sent at once, registers with the prefill server meanwhile
                os.killpg(pid, signal.SIGKILL)  # the API server and its engine processes
            return self.inner.handle_request(request)

    traces: list[PDTrace] = []
    legs = KillThePrefillServer()
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
    client.chat.completions.create(model=push.model, messages=messages("learn4"), max_tokens=1, temperature=0)
    assert wait_idle(push.decode_url) == 0
    idle_usage = metric(push.decode_url, KV_USAGE)
    legs.armed = True
    with pytest.raises((openai.APIStatusError, openai.APIConnectionError)):
        client.chat.completions.create(model=push.model, messages=messages("k"), max_tokens=12, temperature=0)
    cut = time.monotonic()
    assert traces[-1].dispatch == "concurrent" and traces[-1].failed_leg == "prefill", traces[-1]
    held = metric(push.decode_url, KV_USAGE)
    print(f"\ndecode KV usage: idle {idle_usage:.4f}, after the cut {held:.4f}")
    assert held > idle_usage  # the decode had registered: its blocks wait for a WRITE
    client.close()
    reclaimed(push.decode_url, cut)
    assert metric(push.decode_url, KV_USAGE) == idle_usage
