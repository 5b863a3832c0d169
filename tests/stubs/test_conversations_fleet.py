"""Conversations across processes on loopback stubs: the decode endpoint and the decode-only
decision come from the request itself (rendezvous on the affinity key), so clients that
share nothing decide alike, and conversations spread over the decode pool."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest

from pdclient import PDChatClient, PDTrace
from tests.stubserver import Fault, StubServer

SYSTEM = "You are a careful assistant. " + "Answer briefly and cite the manual where you can. " * 30


def conversation(i: int) -> list[dict[str, Any]]:
    return [{"role": "system", "content": f"Conversation {i}. {SYSTEM}"}, {"role": "user", "content": "Hello?"}]


@pytest.fixture
def fleet() -> Iterator[tuple[StubServer, list[StubServer]]]:
    # The stubs count every prompt as 900 ids, about what SYSTEM is.
    with contextlib.ExitStack() as stack:
        prefill, *decodes = (stack.enter_context(StubServer(prompt_tokens=900)) for _ in range(4))
        # A handover as long as a real pair's, which the cost model's decode-only prior beats
        # (the stubs' own is a millisecond: a follow-up would go decode-only only as a trial).
        prefill.fault_hook = lambda received: Fault(delay=0.08) if received.leg == "prefill" else None
        yield prefill, decodes


def client(prefill: StubServer, decodes: list[StubServer], traces: list[PDTrace]) -> PDChatClient:
    return PDChatClient(
        prefill_base_url=prefill.url, decode_base_url=[d.url for d in decodes], api_key="x", on_trace=traces.append
    )


def turn(pd: PDChatClient, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One streamed turn; the messages with its answer and a short follow-up question."""
    chunks = list(pd.chat.completions.create(model="m", messages=messages, stream=True, max_tokens=8))
    assert all(c.usage is None for c in chunks), "the caller did not ask for usage"
    answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]


def test_sequential_conversations_spread_over_the_decode_pool(fleet: tuple[StubServer, list[StubServer]]) -> None:
    """By their hash: the stubs' ports change per run, so enough conversations that an
    endpoint above 1.5x the mean is a 3-sigma event (90 over 3: mean 30, sigma 4.5)."""
    prefill, decodes = fleet
    traces: list[PDTrace] = []
    with client(prefill, decodes, traces) as pd:
        for i in range(90):
            messages = turn(pd, conversation(i))
            if i < 10:
                turn(pd, messages)
    per_stub = [len(d.legs("decode")) for d in decodes]
    mean = sum(per_stub) / len(per_stub)
    assert sum(per_stub) == 100 and max(per_stub) <= 1.5 * mean, per_stub
    # A conversation's turns met on one endpoint.
    assert all(traces[2 * i].decode_url == traces[2 * i + 1].decode_url for i in range(10))
    assert all(t.outcome == "decode_only" for t in traces[1:20:2])


def test_two_clients_alternating_turns_go_decode_only(fleet: tuple[StubServer, list[StubServer]]) -> None:
    prefill, decodes = fleet
    traces_a: list[PDTrace] = []
    traces_b: list[PDTrace] = []
    with client(prefill, decodes, traces_a) as a, client(prefill, decodes, traces_b) as b:
        messages = conversation(0)
        for pd in (a, b, a, b):
            messages = turn(pd, messages)
    first, *follow_ups = [traces_a[0], traces_b[0], traces_a[1], traces_b[1]]
    assert first.outcome == "disaggregated"
    assert [t.outcome for t in follow_ups] == ["decode_only"] * 3, [(t.outcome, t.conversation) for t in follow_ups]
    assert {t.decode_url for t in (first, *follow_ups)} == {first.decode_url}
    assert [t.conversation for t in follow_ups] == ["extends_history", "extends_history", "extends_history"]


def test_a_decode_only_turn_learns_its_prompt_length_from_the_server(
    fleet: tuple[StubServer, list[StubServer]],
) -> None:
    prefill, decodes = fleet
    traces: list[PDTrace] = []
    with client(prefill, decodes, traces) as pd:
        messages = conversation(1)
        for _ in range(4):
            messages = turn(pd, messages)
    assert [t.outcome for t in traces] == ["disaggregated", "decode_only", "decode_only", "decode_only"]
    decode_only = [r.body for d in decodes for r in d.legs("decode") if "kv_transfer_params" not in r.body]
    assert decode_only and all(b["stream_options"] == {"include_usage": True} for b in decode_only)
    # After a decode-only turn the next one's estimate starts from the server's count, not from the text.
    assert traces[3].conversation == "extends_answer"
    assert traces[3].estimated_uncached_tokens is not None and traces[3].estimated_uncached_tokens < 128


def test_replicas_send_a_shared_prefix_to_one_prefill_endpoint(fleet: tuple[StubServer, list[StubServer]]) -> None:
    prefill, decodes = fleet
    prefills = [prefill, *decodes[1:]]
    replicas = [
        PDChatClient(
            prefill_base_url=[p.url for p in prefills],
            decode_base_url=decodes[0].url,
            prefill_routing="prefix_rendezvous",
            api_key="x",
        )
        for _ in range(2)
    ]
    for i in range(8):
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Question {i}?"}]
        replicas[i % 2].chat.completions.create(model="m", messages=messages, max_tokens=4)
    for pd in replicas:
        pd.close()
    assert sorted(len(p.legs("prefill")) for p in prefills) == [0, 0, 8]
