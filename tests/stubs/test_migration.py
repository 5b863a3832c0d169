"""Decode migration (issue 15) over real sockets: a decode server that dies mid-answer costs a pause.

One prefill stub and two or three decode stubs (tests/stubserver.py). A fault hook breaks
every call's first decode (its ``x-request-id`` has no ``-m`` suffix) after a number of SSE
events: closed, reset, or silent past the caller's read timeout. The continuation (request
id ``<id>-m1``) is answered whole, so whichever decode stub a call starts on, it moves.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pdclient import AsyncPDChatClient, BreakerSettings, PDTrace, RetrySettings
from tests.fake_vllm import ANSWER_ID, EOS_ID
from tests.stubserver import Fault, Received, StubServer
from tests.twins import Twin

WORDS = tuple(f" w{i}" for i in range(12))
ANSWER = "".join(WORDS)
MESSAGES: Any = [{"role": "user", "content": "Count to twelve."}]
FAST = RetrySettings(backoff_initial=0.001, backoff_max=0.01)


def first_decodes(fault: Fault) -> Any:
    """A fault hook: ``fault`` on each call's first decode, none on its continuations."""

    def hook(received: Received) -> Fault | None:
        if received.leg == "decode" and "-m" not in received.headers.get("x-request-id", ""):
            return fault
        return None

    return hook


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[StubServer, StubServer, StubServer, StubServer]]:
    with (
        StubServer(words=WORDS) as prefill,
        StubServer(words=WORDS) as d1,
        StubServer(words=WORDS) as d2,
        StubServer(words=WORDS) as d3,
    ):
        yield prefill, d1, d2, d3


@pytest.fixture
def pool(servers: tuple[StubServer, ...]) -> tuple[StubServer, ...]:
    for server in servers:
        server.clear()
        server.fault_hook = None
    return servers


def decodes(*servers: StubServer) -> list[Received]:
    return sorted((r for s in servers for r in s.legs("decode")), key=lambda r: r.headers["x-request-id"])


async def stream_chunks(twin: Twin, **kwargs: Any) -> list[Any]:
    stream = await twin.chat(messages=MESSAGES, stream=True, **kwargs)
    return list(stream) if twin.mode == "sync" else [c async for c in stream]


def text(chunks: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize(
    ("events", "fault"),
    [
        (2, Fault(drop_after_events=2)),
        (7, Fault(drop_after_events=7)),
        (5, Fault(drop_after_events=5, reset=True)),
    ],
    ids=["closed after 1 token", "closed after 6 tokens", "reset after 4 tokens"],
)
async def test_a_decode_that_dies_mid_answer_costs_a_pause(
    mode: str, pool: tuple[StubServer, ...], events: int, fault: Fault
) -> None:
    prefill, d1, d2, _ = pool
    for server in (d1, d2):
        server.fault_hook = first_decodes(fault)
    traces: list[PDTrace] = []
    twin = Twin(
        mode, prefill_base_url=prefill.url, decode_base_url=[d1.url, d2.url], retries=FAST, on_trace=traces.append
    )
    chunks = await stream_chunks(twin, max_tokens=40, stream_options={"include_usage": True})
    await twin.close()

    kept = events - 1  # the first event is the role chunk
    assert text(chunks) == ANSWER, "whole, in order, nothing twice"
    assert all("token_ids" not in (c.choices[0].model_extra or {}) for c in chunks if c.choices)
    first, continuation = decodes(d1, d2)
    assert first.body["return_token_ids"] is True
    assert continuation.client_port != first.client_port
    prompt = continuation.body["kv_transfer_params"]["prompt_token_ids"]
    assert prompt == prefill.prompt_ids({"messages": MESSAGES}) + [ANSWER_ID + i for i in range(kept)]
    assert continuation.ids_match is True and "remote_engine_id" not in continuation.body["kv_transfer_params"]
    assert continuation.body["max_tokens"] == 40 - kept
    assert continuation.headers["x-request-id"] == first.headers["x-request-id"] + "-m1"
    usage = chunks[-1].usage
    assert usage.prompt_tokens == prefill.prompt_tokens and usage.completion_tokens == len(WORDS)
    (trace,) = traces
    (moved,) = trace.migrations
    assert moved.after_tokens == kept and moved.from_url != moved.to_url
    assert {moved.from_url, moved.to_url} == {d1.url, d2.url} and trace.decode_url == moved.to_url
    assert moved.pause_ms is not None and moved.pause_ms < 2000


async def test_a_read_timeout_between_chunks_moves_the_stream(mode: str, pool: tuple[StubServer, ...]) -> None:
    prefill, d1, d2, _ = pool
    gate = threading.Semaphore(3)  # three events, then the server stalls
    for server in (d1, d2):
        server.fault_hook = first_decodes(Fault(event_gate=gate))
    traces: list[PDTrace] = []
    twin = Twin(
        mode, prefill_base_url=prefill.url, decode_base_url=[d1.url, d2.url], retries=FAST, on_trace=traces.append
    )
    chunks = await stream_chunks(twin, timeout=1.0)
    await twin.close()
    assert text(chunks) == ANSWER
    assert "ReadTimeout" in traces[0].migrations[0].cause and traces[0].migrations[0].after_tokens == 3


async def test_completions_move_with_an_id_prompt(mode: str, pool: tuple[StubServer, ...]) -> None:
    prefill, d1, d2, _ = pool
    for server in (d1, d2):
        server.fault_hook = first_decodes(Fault(drop_after_events=3))
    twin = Twin(mode, prefill_base_url=prefill.url, decode_base_url=[d1.url, d2.url], retries=FAST)
    stream = await twin.call(twin.client.completions.create, model="m", prompt="Count:", stream=True, max_tokens=30)
    chunks = list(stream) if mode == "sync" else [c async for c in stream]
    await twin.close()
    assert "".join(c.choices[0].text for c in chunks) == ANSWER
    _, continuation = decodes(d1, d2)
    assert continuation.body["prompt"][-3:] == [ANSWER_ID, ANSWER_ID + 1, ANSWER_ID + 2]
    assert continuation.body["max_tokens"] == 27


async def test_a_continuation_never_carries_the_callers_request_id(mode: str, pool: tuple[StubServer, ...]) -> None:
    """A moved stream's legs carry the call's leg id with ``-m<n>``, not the caller's id."""
    prefill, d1, d2, _ = pool
    for server in (d1, d2):
        server.fault_hook = first_decodes(Fault(drop_after_events=3))
    twin = Twin(mode, prefill_base_url=prefill.url, decode_base_url=[d1.url, d2.url], retries=FAST)
    chunks = await stream_chunks(twin, extra_headers={"x-request-id": "victim"})
    await twin.close()
    assert text(chunks) == ANSWER
    first, continuation = decodes(d1, d2)
    assert continuation.headers["x-request-id"] == first.headers["x-request-id"] + "-m1"
    assert not first.headers["x-request-id"].startswith("victim")


async def test_the_callers_own_ids_are_whole_across_the_cut(mode: str, pool: tuple[StubServer, ...]) -> None:
    prefill, d1, d2, _ = pool
    for server in (d1, d2):
        server.fault_hook = first_decodes(Fault(drop_after_events=4))
    twin = Twin(mode, prefill_base_url=prefill.url, decode_base_url=[d1.url, d2.url], retries=FAST)
    chunks = await stream_chunks(twin, extra_body={"return_token_ids": True})
    await twin.close()
    ids = [i for c in chunks if c.choices for i in (c.choices[0].model_extra or {}).get("token_ids") or []]
    assert ids == [ANSWER_ID + i for i in range(len(WORDS))] + [EOS_ID]


async def test_moves_are_bounded(mode: str, pool: tuple[StubServer, ...]) -> None:
    prefill, d1, d2, d3 = pool

    def every_decode(received: Received) -> Fault | None:
        return Fault(drop_after_events=3) if received.leg == "decode" else None

    for server in (d1, d2, d3):
        server.fault_hook = every_decode
    for limit, urls, reason in (
        (1, [d1.url, d2.url, d3.url], r"max_decode_migrations \(1\) reached"),
        (5, [d1.url, d2.url], "no other decode endpoint is admitted"),
    ):
        for server in pool:
            server.clear()
        traces: list[PDTrace] = []
        twin = Twin(
            mode,
            prefill_base_url=prefill.url,
            decode_base_url=urls,
            retries=FAST,
            max_decode_migrations=limit,
            on_trace=traces.append,
        )
        with pytest.raises(openai.APIConnectionError, match=reason):
            await stream_chunks(twin)
        await twin.close()
        assert len(decodes(d1, d2, d3)) == 2 and len(traces[0].migrations) == 1


@pytest.mark.timeout(300)
async def test_many_calls_each_cut_once_all_arrive_whole() -> None:
    """300 calls at concurrency 32 over three decode stubs; every first decode dies at a random
    event (closed or reset). Every answer arrives whole, no id reaches another call, nothing leaks."""
    rng = random.Random(15)
    lock = threading.Lock()

    def hook(received: Received) -> Fault | None:
        if received.leg != "decode" or "-m" in received.headers.get("x-request-id", ""):
            return None
        with lock:
            return Fault(drop_after_events=rng.randint(1, len(WORDS) + 1), reset=rng.random() < 0.5)

    with (
        StubServer(words=WORDS) as prefill,
        StubServer(words=WORDS) as d1,
        StubServer(words=WORDS) as d2,
        StubServer(words=WORDS) as d3,
    ):
        for server in (d1, d2, d3):
            server.fault_hook = hook
        client = AsyncPDChatClient(
            prefill_base_url=prefill.url,
            decode_base_url=[d1.url, d2.url, d3.url],
            api_key="-",
            max_retries=0,
            retries=FAST,
            # Every call breaks one stream on purpose: the breakers must not count that as an outage.
            breaker=BreakerSettings(failures=100_000),
        )
        gate = asyncio.Semaphore(32)
        texts: list[str] = []

        async def one(i: int) -> None:
            messages = [{"role": "user", "content": f"call {i}"}]
            async with gate:
                stream = await client.chat.completions.create(model="m", messages=messages, stream=True)  # type: ignore[arg-type]
                texts.append("".join([c.choices[0].delta.content or "" async for c in stream if c.choices]))

        await asyncio.gather(*(one(i) for i in range(300)))
        fleet = client.pd_fleet
        in_flight = [(e.in_flight, e.streaming) for e in (*fleet.prefill.endpoints, *fleet.decode.endpoints)]
        await client.close()
        continuations = [r for s in (d1, d2, d3) for r in s.legs("decode") if "-m1" in r.headers["x-request-id"]]

    assert texts == [ANSWER] * 300
    assert len(continuations) == 300
    assert all(r.ids_match for r in continuations), "a continuation received another call's prompt"
    assert in_flight == [(0, 0)] * 4  # calls and streams all ended


# -- a stream cut after its answer ended -----------------------------------------------------

ROLE, FINISH = 1, 1  # the events around the words: the role chunk first, the finish chunk last


def finishes(chunks: list[Any]) -> list[str]:
    return [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]


@pytest.mark.parametrize(
    ("max_tokens", "cut_after", "finish", "completion_tokens"),
    [
        # Before the usage event and [DONE]: pdclient counts the ids it holds, as vLLM does (the
        # twelve words and the end-of-sequence token, whose id came with the finish chunk).
        (40, ROLE + len(WORDS) + FINISH, "stop", len(WORDS) + 1),
        (5, ROLE + 5 + FINISH, "length", 5),  # a budget spent: nothing left to continue with
        (40, ROLE + len(WORDS) + FINISH + 1, "stop", len(WORDS)),  # after the stub's own usage event
    ],
    ids=["stop, before its usage", "length, before its usage", "stop, before [DONE]"],
)
async def test_a_stream_cut_after_its_finish_is_ended_not_moved(
    mode: str, pool: tuple[StubServer, ...], max_tokens: int, cut_after: int, finish: str, completion_tokens: int
) -> None:
    prefill, d1, d2, _ = pool
    for server in (d1, d2):
        server.fault_hook = first_decodes(Fault(drop_after_events=cut_after, reset=True))
    traces: list[PDTrace] = []
    twin = Twin(
        mode, prefill_base_url=prefill.url, decode_base_url=[d1.url, d2.url], retries=FAST, on_trace=traces.append
    )
    chunks = await stream_chunks(twin, max_tokens=max_tokens, stream_options={"include_usage": True})
    await twin.close()

    assert text(chunks) == "".join(WORDS[:max_tokens]), "the answer once, nothing after its end"
    assert finishes(chunks) == [finish]
    (usage,) = [c.usage for c in chunks if c.usage is not None]
    assert usage.prompt_tokens == prefill.prompt_tokens and usage.completion_tokens == completion_tokens
    assert len(decodes(d1, d2)) == 1, "no continuation was asked for"
    (trace,) = traces
    assert trace.outcome.value == "disaggregated" and trace.error is None and trace.migrations == ()


# -- non-streamed calls ---------------------------------------------------------------------------

VLLM_CHAT_FIELDS = [
    "id",
    "object",
    "created",
    "model",
    "choices",
    "service_tier",
    "system_fingerprint",
    "usage",
    "prompt_logprobs",
    "prompt_token_ids",
    "prompt_text",
    "kv_transfer_params",
    "ec_transfer_params",
    "metrics",
]


async def raw_chat(twin: Twin, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    """A non-streamed call's parsed answer and the JSON body it was parsed from."""
    raw = await twin.call(twin.client.chat.completions.with_raw_response.create, model="m", messages=MESSAGES, **kwargs)
    return raw.parse(), raw.http_response.json()


@pytest.mark.parametrize("cut_after", [2, 7], ids=["after 1 token", "after 6 tokens"])
async def test_a_non_streamed_call_moves_and_gets_one_json_body(
    mode: str, pool: tuple[StubServer, ...], cut_after: int
) -> None:
    prefill, d1, d2, _ = pool
    for server in (d1, d2):
        server.fault_hook = first_decodes(Fault(drop_after_events=cut_after, reset=True))
    traces: list[PDTrace] = []
    twin = Twin(
        mode,
        prefill_base_url=prefill.url,
        decode_base_url=[d1.url, d2.url],
        retries=FAST,
        on_trace=traces.append,
        migrate_non_streamed=True,
    )
    answer, body = await raw_chat(twin, max_tokens=40)
    await twin.close()

    kept = cut_after - ROLE
    assert answer.choices[0].message.content == ANSWER and answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens == prefill.prompt_tokens and answer.usage.completion_tokens == len(WORDS)
    assert list(body) == VLLM_CHAT_FIELDS and body["prompt_token_ids"] is None
    assert body["choices"][0]["token_ids"] is None and body["id"] == "chatcmpl-d"
    first, continuation = decodes(d1, d2)
    for leg in (first, continuation):
        assert leg.body["stream"] is True and leg.body["stream_options"] == {"include_usage": True}
        assert leg.body["return_token_ids"] is True
    assert continuation.body["max_tokens"] == 40 - kept and continuation.ids_match is True
    (trace,) = traces
    (moved,) = trace.migrations
    assert trace.outcome.value == "disaggregated" and trace.error is None and moved.after_tokens == kept


async def test_a_non_streamed_completions_call_moves(mode: str, pool: tuple[StubServer, ...]) -> None:
    prefill, d1, d2, _ = pool
    for server in (d1, d2):
        server.fault_hook = first_decodes(Fault(drop_after_events=3))
    twin = Twin(
        mode, prefill_base_url=prefill.url, decode_base_url=[d1.url, d2.url], retries=FAST, migrate_non_streamed=True
    )
    answer = await twin.call(twin.client.completions.create, model="m", prompt="Count:", max_tokens=30)
    await twin.close()
    assert answer.choices[0].text == ANSWER and answer.usage.completion_tokens == len(WORDS)
    _, continuation = decodes(d1, d2)
    assert continuation.body["prompt"][-3:] == [ANSWER_ID, ANSWER_ID + 1, ANSWER_ID + 2]


async def test_a_non_streamed_call_cut_after_its_finish_keeps_its_answer(
    mode: str, pool: tuple[StubServer, ...]
) -> None:
    prefill, d1, d2, _ = pool
    for server in (d1, d2):
        server.fault_hook = first_decodes(Fault(drop_after_events=ROLE + 5 + FINISH))
    twin = Twin(
        mode, prefill_base_url=prefill.url, decode_base_url=[d1.url, d2.url], retries=FAST, migrate_non_streamed=True
    )
    answer, body = await raw_chat(twin, max_tokens=5, extra_body={"return_token_ids": True})
    await twin.close()
    assert answer.choices[0].message.content == "".join(WORDS[:5]) and answer.choices[0].finish_reason == "length"
    assert body["choices"][0]["token_ids"] == [ANSWER_ID + i for i in range(5)]
    assert body["prompt_token_ids"] == prefill.prompt_ids({"messages": MESSAGES})
    assert answer.usage.prompt_tokens == prefill.prompt_tokens and answer.usage.completion_tokens == 5
    assert len(decodes(d1, d2)) == 1
