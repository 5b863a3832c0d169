"""``dispatch="auto"`` on the cost model over real sockets: the loopback stubs in push mode,
delayed as a GPU pair (a handover that concurrency hides) and as the CPU pair (a waiting
decode that slows its prefill), settle on concurrent and on sequential; sync and async."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pdclient import PDChatClient, PDTrace
from pdclient.pools import RetrySettings
from tests.stubserver import Fault, Received, StubServer
from tests.twins import Twin

MESSAGES: Any = [{"role": "user", "content": "Say hello."}]
CALLS = 28
"""Enough for both modes' 4 timings, and settled calls after, on a loaded machine."""


def is_concurrent(received: Received) -> bool:
    params = received.body.get("kv_transfer_params") if isinstance(received.body, dict) else None
    return isinstance(params, dict) and params.get("remote_block_ids") == []


def delays(prefill_s: float, sequential_s: float, concurrent_s: float) -> Callable[[Received], Fault | None]:
    def hook(received: Received) -> Fault | None:
        if received.leg == "prefill":
            return Fault(delay=prefill_s)
        if received.leg == "decode":
            return Fault(delay=concurrent_s if is_concurrent(received) else sequential_s)
        return None

    return hook


async def run(mode: str, pair: tuple[StubServer, StubServer], remote_prefill: str = "auto") -> list[PDTrace]:
    prefill, decode = pair
    traces: list[PDTrace] = []
    twin = Twin(
        mode,
        prefill_base_url=prefill.url,
        decode_base_url=decode.url,
        retries=RetrySettings(backoff_initial=0.001, backoff_max=0.01),
        dispatch="auto",
        remote_prefill=remote_prefill,
        on_trace=traces.append,
    )
    for _ in range(CALLS):
        await twin.stream_text(messages=MESSAGES, max_tokens=4)
    await twin.close()
    return traces


def ttft(trace: PDTrace) -> float:
    """The call's start to the decode's first byte."""
    assert trace.decode_first_byte_ms is not None
    if trace.dispatch == "concurrent":
        return trace.decode_first_byte_ms
    assert trace.prefill_ms is not None
    return trace.prefill_ms + trace.decode_first_byte_ms


@pytest.mark.parametrize("remote_prefill", ["auto", "always"])
async def test_auto_settles_on_concurrent_where_it_hides_a_gpu_handover(
    mode: str, push_pair: tuple[StubServer, StubServer], remote_prefill: str
) -> None:
    """A GPU pair's regime: a prefill of ~40 ms and a handover of ~150 ms (the decode's
    admission, its block allocation, the KV's move) after it, which a decode sent with its
    prefill does while the prefill computes: its first token comes ~20 ms after the
    prefill's end. With or without an estimate (``always`` makes none), the choice predicts
    at the token count the timings were learnt at."""
    push_pair[0].fault_hook = push_pair[1].fault_hook = delays(0.04, 0.15, 0.06)
    traces = await run(mode, push_pair, remote_prefill)
    assert traces[0].dispatch == "sequential" and traces[0].decision is not None
    settled = traces[-8:]  # one may be a probe of the other mode
    assert [t.dispatch for t in settled].count("concurrent") >= 7, [t.decision for t in traces]
    last = settled[-1].decision
    assert last is not None and last.dispatch_reason == "concurrent_faster"
    assert last.concurrent_ms is not None and last.sequential_ms is not None
    assert last.concurrent_ms < 0.6 * last.sequential_ms
    concurrent = statistics.median(ttft(t) for t in traces if t.dispatch == "concurrent")
    sequential = statistics.median(ttft(t) for t in traces if t.dispatch == "sequential")
    assert concurrent < 0.6 * sequential, (concurrent, sequential)
    assert 0.5 * sequential < last.sequential_ms < 2 * sequential
    assert 0.5 * concurrent < last.concurrent_ms < 2 * concurrent


async def test_auto_settles_on_sequential_where_the_waiting_decode_costs_more(
    mode: str, push_pair: tuple[StubServer, StubServer]
) -> None:
    """The CPU pair's regime: the waiting decode takes the core its prefill needs, so a
    concurrent call answers later than a sequential one (1.49x measured at ~1k tokens)."""
    push_pair[0].fault_hook = push_pair[1].fault_hook = delays(0.04, 0.01, 0.1)
    traces = await run(mode, push_pair)
    settled = traces[-8:]
    assert [t.dispatch for t in settled].count("sequential") >= 7, [t.decision for t in traces]
    last = settled[-1].decision
    assert last is not None and last.dispatch_reason == "sequential_faster"
    assert last.concurrent_ms is not None and last.sequential_ms is not None
    assert last.sequential_ms < last.concurrent_ms


# -- remote_prefill="auto" ---------------------------------------------------------------

SYSTEM = "You are a careful assistant. " + "Answer briefly and cite the manual where you can. " * 30


@pytest.fixture
def chat_pair() -> Iterator[tuple[StubServer, StubServer]]:
    # The stubs count every prompt as 900 ids, about what SYSTEM is.
    with StubServer(prompt_tokens=900) as prefill, StubServer(prompt_tokens=900) as decode:
        yield prefill, decode


def is_decode_only(received: Received) -> bool:
    return isinstance(received.body, dict) and "kv_transfer_params" not in received.body


def conversations(
    pair: tuple[StubServer, StubServer], follow_ups: list[str], decode_only_s: float, handover_s: float
) -> list[PDTrace]:
    """One conversation per follow-up: a first turn, then the follow-up; streamed, in turn."""
    prefill, decode = pair

    def hook(received: Received) -> Fault | None:
        if received.leg == "prefill":
            return Fault(delay=handover_s)
        if received.leg == "decode" and is_decode_only(received):
            return Fault(delay=decode_only_s)
        return None

    prefill.fault_hook = decode.fault_hook = hook
    traces: list[PDTrace] = []
    with PDChatClient(
        prefill_base_url=prefill.url, decode_base_url=decode.url, api_key="x", on_trace=traces.append
    ) as pd:
        for i, follow_up in enumerate(follow_ups):
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": f"Conversation {i}. {SYSTEM}"},
                {"role": "user", "content": "Hello?"},
            ]
            for _ in range(2):
                chunks = list(pd.chat.completions.create(model="m", messages=messages, stream=True, max_tokens=4))
                answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                messages = [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": follow_up}]
    return traces[1::2]  # the follow-ups


def test_auto_hands_off_follow_ups_once_it_learns_the_decode_prefills_slowly(
    chat_pair: tuple[StubServer, StubServer],
) -> None:
    """A decode server that takes 300 ms for a short follow-up, against a 10 ms handover:
    once the first handoffs are timed, decode-only is tried on every other follow-up until
    it is timed too (``probe``), and its 300 ms then hand the rest off."""
    traces = conversations(chat_pair, ["And then?"] * 12, decode_only_s=0.3, handover_s=0.01)
    reasons = [t.remote_prefill_reason for t in traces]
    assert reasons[:8].count("probe") >= 3 and reasons[:8].count("handoff_faster") >= 3, reasons
    assert reasons[8:] == ["handoff_faster"] * 4, reasons
    last = traces[-1].decision
    assert last is not None and last.decode_only_ms is not None and last.handoff_ms is not None
    assert last.decode_only_ms > 250 > 100 > last.handoff_ms


def test_auto_keeps_long_follow_ups_decode_only_once_it_learns_the_decode_prefills_fast(
    chat_pair: tuple[StubServer, StubServer],
) -> None:
    """A decode server that answers at once, against a 150 ms handover: follow-ups longer
    than the fixed rule's 256 tokens, handed off under the priors, go decode-only once the
    short ones taught the decode's rate."""
    short = [" ".join(["Tell me more about this."] * n) for n in (1, 8, 16, 24, 4, 12, 20, 2)]
    long = [" ".join(["And now explain the whole chapter in detail."] * 25)] * 4
    traces = conversations(chat_pair, [*short, *long], decode_only_s=0.0, handover_s=0.15)
    long_traces = traces[len(short) :]
    assert all(t.estimated_uncached_tokens is not None and t.estimated_uncached_tokens > 256 for t in long_traces)
    assert [t.remote_prefill_reason for t in long_traces] == ["decode_only_faster"] * len(long)
    assert all(t.outcome == "decode_only" for t in long_traces)
