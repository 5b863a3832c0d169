"""``remote_prefill="auto"`` through ``pdclient serve`` workers and replicas that share nothing:
a follow-up is decided from the request itself, so it goes decode-only to the decode endpoint
its conversation is routed to whichever worker or replica takes it."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.serve.process import ServeProcess
from tests.stubserver import StubServer

SYSTEM = "You are a careful assistant. " + "Answer briefly and cite the manual where you can. " * 30
CONVERSATIONS = 12


@pytest.fixture
def fleet() -> Iterator[tuple[StubServer, list[StubServer]]]:
    # The stubs count every prompt as 900 ids, about what SYSTEM is.
    with contextlib.ExitStack() as stack:
        prefill, *decodes = (stack.enter_context(StubServer(prompt_tokens=900)) for _ in range(4))
        yield prefill, decodes


def chat(url: str, messages: list[dict[str, Any]]) -> str:
    """One call on a new connection, as a load balancer in front of replicas would make it."""
    response = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": messages}, timeout=30)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def decode_only_share(proxies: list[str], prefill: StubServer) -> float:
    """Two-turn conversations, the turns dealt round-robin over ``proxies``: the follow-ups' decode-only share."""
    urls = itertools.cycle(proxies)
    before = len(prefill.legs("prefill"))
    for i in range(CONVERSATIONS):
        messages = [{"role": "system", "content": f"Conversation {i}. {SYSTEM}"}, {"role": "user", "content": "Hi?"}]
        answer = chat(next(urls), messages)
        chat(next(urls), [*messages, {"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}])
    handoffs = len(prefill.legs("prefill")) - before
    return (2 * CONVERSATIONS - handoffs) / CONVERSATIONS


def serve(prefill: StubServer, decodes: list[StubServer], workers: int) -> ServeProcess:
    return ServeProcess("--prefill", prefill.url, "--decode", *(d.url for d in decodes), workers=workers)


def test_workers_and_replicas_decide_as_one_process(fleet: tuple[StubServer, list[StubServer]]) -> None:
    prefill, decodes = fleet
    one = serve(prefill, decodes, 1)
    try:
        alone = decode_only_share([one.url], prefill)
    finally:
        one.stop()
    four = serve(prefill, decodes, 4)
    try:
        workers = decode_only_share([four.url], prefill)
    finally:
        four.stop()
    a, b = serve(prefill, decodes, 1), serve(prefill, decodes, 1)
    try:
        replicas = decode_only_share([a.url, b.url], prefill)
    finally:
        a.stop()
        b.stop()
    assert alone == 1.0
    assert abs(workers - alone) <= 0.05 and abs(replicas - alone) <= 0.05, (alone, workers, replicas)
