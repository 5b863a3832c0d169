"""Connection-level faults over real sockets (the loopback stub), sync and async, and a soak run."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pdclient import AsyncPDChatClient, PDTrace
from pdclient.pools import RetrySettings
from tests.stubserver import Fault, Received, StubServer, closed_port_url
from tests.twins import Twin

MESSAGES: Any = [{"role": "user", "content": "Say hello."}]
STUB_ANSWER = "Hello from the decode stub"
FAST = RetrySettings(backoff_initial=0.001, backoff_max=0.01)


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[StubServer, StubServer]]:
    with StubServer(prompt_tokens=64) as prefill, StubServer(prompt_tokens=64) as decode:
        yield prefill, decode


@pytest.fixture
def pair(servers: tuple[StubServer, StubServer]) -> tuple[StubServer, StubServer]:
    for server in servers:
        server.clear()
    return servers


async def test_prefill_connection_refused_falls_back(mode: str, pair: tuple[StubServer, StubServer]) -> None:
    _, decode = pair
    traces: list[PDTrace] = []
    twin = Twin(
        mode, prefill_base_url=closed_port_url(), decode_base_url=decode.url, retries=FAST, on_trace=traces.append
    )
    assert "".join(await twin.stream_text(messages=MESSAGES)) == STUB_ANSWER
    assert traces[0].fallback is not None and "ConnectError" in traces[0].fallback
    assert decode.legs("decode")[0].forwarded_ids is None
    await twin.close()


async def test_slow_prefill_cannot_stall_the_call_past_its_timeout(
    mode: str, pair: tuple[StubServer, StubServer]
) -> None:
    prefill, decode = pair
    prefill.inject(Fault(delay=5.0), leg="prefill", times=10)
    traces: list[PDTrace] = []
    twin = Twin(mode, prefill_base_url=prefill.url, decode_base_url=decode.url, retries=FAST, on_trace=traces.append)
    started = time.monotonic()
    text = await twin.stream_text(messages=MESSAGES, timeout=1.0)
    elapsed = time.monotonic() - started
    assert "".join(text) == STUB_ANSWER
    assert elapsed < 2.5, f"the prefill phase ended at the call's 1 s timeout, took {elapsed:.2f} s"
    assert traces[0].fallback is not None and "ReadTimeout" in traces[0].fallback
    await twin.close()


async def test_decode_dropped_mid_stream_is_a_clean_error(mode: str, pair: tuple[StubServer, StubServer]) -> None:
    prefill, decode = pair
    decode.inject(Fault(drop_after_events=2), leg="decode")
    twin = Twin(mode, prefill_base_url=prefill.url, decode_base_url=decode.url, retries=FAST)
    with pytest.raises(openai.APIConnectionError):
        await twin.stream_text(messages=MESSAGES)
    assert len(decode.legs("decode")) == 1, "never retried once the stream started"
    await twin.close()


async def test_decode_connection_dropped_before_answer(mode: str, pair: tuple[StubServer, StubServer]) -> None:
    prefill, _ = pair
    # A decode stub of its own: a KV release sent in the background by an earlier test's
    # failed call must not be the request that meets this fault.
    with StubServer(prompt_tokens=64) as decode:
        decode.inject(Fault(drop=True), leg="decode")
        twin = Twin(mode, prefill_base_url=prefill.url, decode_base_url=decode.url, retries=FAST)
        with pytest.raises(openai.APIConnectionError):
            await twin.chat(messages=MESSAGES)
        await twin.close()


SOAK_CALLS = 2000
SOAK_CONCURRENCY = 128


def random_faults(seed: int) -> Any:
    rng = random.Random(seed)
    lock = __import__("threading").Lock()

    def hook(received: Received) -> Fault | None:
        with lock:
            roll = rng.random()
        if received.leg == "prefill":
            if roll < 0.04:
                return Fault(status=503)
            if roll < 0.06:
                return Fault(status=429)
            if roll < 0.08:
                return Fault(drop=True)
            if roll < 0.10:
                return Fault(delay=0.05)
        elif received.leg == "decode":
            if roll < 0.02:
                return Fault(status=500)
            if roll < 0.04:
                return Fault(drop=True)
            if roll < 0.06:
                return Fault(drop_after_events=2)
        return None

    return hook


@pytest.mark.timeout(600)
async def test_soak_random_faults_never_mix_ids_or_leak() -> None:
    """2,000 calls at concurrency 128 over 2 prefill and 2 decode stubs injecting random faults."""
    with (
        StubServer(prompt_tokens=64) as p1,
        StubServer(prompt_tokens=64) as p2,
        StubServer(prompt_tokens=64) as d1,
        StubServer(prompt_tokens=64) as d2,
    ):
        for index, server in enumerate((p1, p2, d1, d2)):
            server.fault_hook = random_faults(index)
        client = AsyncPDChatClient(
            prefill_base_url=[p1.url, p2.url],
            decode_base_url=[d1.url, d2.url],
            api_key="-",
            max_retries=1,
            retries=FAST,
            routing="power_of_two",
        )
        gate = asyncio.Semaphore(SOAK_CONCURRENCY)
        outcomes: list[str] = []

        async def one(i: int) -> None:
            messages = [{"role": "user", "content": f"soak call {i}"}]
            async with gate:
                try:
                    stream = await client.chat.completions.create(model="m", messages=messages, stream=True)  # type: ignore[arg-type]
                    text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
                    outcomes.append("ok" if text == STUB_ANSWER else f"wrong answer: {text!r}")
                except openai.APIError as exc:
                    outcomes.append(f"error: {type(exc).__name__}")

        started = time.monotonic()
        await asyncio.gather(*(one(i) for i in range(SOAK_CALLS)))
        elapsed = time.monotonic() - started
        fleet = client.pd_fleet
        in_flight = [(e.in_flight, e.streaming) for e in (*fleet.prefill.endpoints, *fleet.decode.endpoints)]
        # httpcore's pool, read for the test only: every leg connection must be back in it.
        pool = client._client._transport._legs._client._transport._pool  # type: ignore[attr-defined]
        busy_connections = [c for c in pool.connections if "ACTIVE" in c.info()]
        await client.close()

    decodes = d1.legs("decode") + d2.legs("decode")
    with_ids = [r for r in decodes if r.forwarded_ids is not None]
    tally: dict[str, int] = {}
    for outcome in outcomes:
        tally[outcome] = tally.get(outcome, 0) + 1
    print(f"\nsoak: {SOAK_CALLS} calls in {elapsed:.1f} s: {tally}; {len(with_ids)} decodes with forwarded ids")
    assert len(outcomes) == SOAK_CALLS
    assert [o for o in outcomes if o.startswith("wrong")] == []
    assert [r for r in with_ids if r.ids_match is not True] == [], "a decode received another call's ids"
    assert tally.get("ok", 0) > SOAK_CALLS * 0.8
    assert in_flight == [(0, 0)] * 4  # calls and streams all ended
    assert busy_connections == []


async def test_prefill_timeout_bounds_the_prefill_phase(mode: str, pair: tuple[StubServer, StubServer]) -> None:
    prefill, decode = pair
    prefill.inject(Fault(delay=5.0), leg="prefill", times=10)
    traces: list[PDTrace] = []
    retries = RetrySettings(backoff_initial=0.001, backoff_max=0.01, prefill_timeout=0.8)
    twin = Twin(mode, prefill_base_url=prefill.url, decode_base_url=decode.url, retries=retries, on_trace=traces.append)
    started = time.monotonic()
    text = await twin.stream_text(messages=MESSAGES)  # openai's own timeout: 600 s
    assert "".join(text) == STUB_ANSWER
    assert time.monotonic() - started < 2.5
    assert traces[0].fallback is not None and "ReadTimeout" in traces[0].fallback
    await twin.close()
