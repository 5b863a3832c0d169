"""``prefill_routing="cache_aware"`` by the prefill servers' own KV events, on real servers.

One start of three (``LocalPD(prefill_servers=2, kv_events=True)``: two prefills, one
decode, every server publishing its events; ``VLLM_SERVER_DEV_MODE=1`` for
``POST /reset_prefix_cache``), one test: a conversation's handoffs go to the prefill whose
events hold most of its known ids (rule ``events``), and that server's own metrics say it
found them in its prefix cache, the other's that it found nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdclient import ConversationSettings, Outcome, PDTrace
from pdclient.local import LocalPD
from pdclient.wire import Kind, affinity_key

from .helpers import GREEDY, metric
from .test_kv_events import conversation, events_client, settled, wait_for

HITS = "vllm:prefix_cache_hits_total"


@pytest.fixture(scope="module")
def two_prefills() -> Iterator[LocalPD]:
    with LocalPD(prefill_servers=2, kv_events=True, server_env={"VLLM_SERVER_DEV_MODE": "1"}) as pd:
        yield pd


def held_of(trace: PDTrace) -> int:
    """The tokens the chosen prefill's events held, from the route's own account (``held=``)."""
    route = trace.prefill_route or ""
    assert route.startswith("cache_aware/events held="), route
    return int(route.split("held=", 1)[1].split()[0])


def test_a_conversations_handoffs_follow_the_prefill_servers_events(two_prefills: LocalPD) -> None:
    """Turn 1 lands on prefill A (no events hold it yet). Turn 2's handoff goes to A by its
    events, and A's metrics count the hits its usage reports, B's none. Then A's cache is
    reset and the conversation's prompt cached on B instead (a call straight to B): turn 3
    goes to B by B's events, although this process sent every earlier turn to A."""
    pd = two_prefills
    traces: list[PDTrace] = []
    with events_client(
        pd,
        traces,
        prefill_routing="cache_aware",
        # Every follow-up a handoff: the prefill's routing is what is checked here.
        conversations=ConversationSettings(max_uncached_ratio=0.001),
    ) as (client, _decode):
        feeds = client.pd_fleet.kv_events
        assert feeds is not None

        def index(url: str) -> Any:
            wait_for(lambda: feeds.index(url) is not None and feeds.index(url).synced, f"{url}'s events")  # type: ignore[union-attr]
            return feeds.index(url)

        indexes = {url: index(url) for url in pd.prefill_urls}

        def ask(messages: list[dict[str, Any]]) -> tuple[Any, PDTrace, dict[str, float]]:
            """One call, its trace, and each prefill's prefix-cache hits during it (its metrics)."""
            before = {url: metric(url, HITS) for url in pd.prefill_urls}
            answer = client.chat.completions.create(model=pd.model, messages=messages, **GREEDY)  # type: ignore[arg-type]
            hits = {url: metric(url, HITS) - before[url] for url in pd.prefill_urls}
            trace = traces[-1]
            assert trace.outcome is Outcome.DISAGGREGATED, trace
            return answer, trace, hits

        def follow_up(messages: list[dict[str, Any]], answer: Any, question: str) -> list[dict[str, Any]]:
            said = {"role": "assistant", "content": answer.choices[0].message.content}
            return [*messages, said, {"role": "user", "content": question}]

        turn1 = conversation()
        answer, t1, _ = ask(turn1)
        a = t1.prefill_url
        assert a is not None and t1.prefill_route is not None and "events" not in t1.prefill_route
        b = next(url for url in pd.prefill_urls if url != a)
        settled(indexes[a])

        turn2 = follow_up(turn1, answer, "Give it a title.")
        answer, t2, hits = ask(turn2)
        cached = answer.usage.prompt_tokens_details.cached_tokens  # a P/D call's: the prefill's own
        assert t2.prefill_url == a and held_of(t2) > 0
        assert hits[a] == cached > 0 and hits[b] == 0, (hits, cached)
        assert held_of(t2) <= cached
        record = [("turn 2", "A", held_of(t2), cached, hits[a], hits[b])]

        # A forgets everything; B caches the conversation's last prompt from a call of its own.
        settled(indexes[a])
        with httpx.Client(timeout=120) as http:
            root = a.removesuffix("/v1")
            assert http.post(root + "/reset_prefix_cache").json() == {"success": True}
            # vLLM publishes a reset with its next engine step: a prompt shorter than a block.
            hi = {"model": pd.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
            http.post(a + "/chat/completions", json=hi).raise_for_status()
            http.post(b + "/chat/completions", json={**hi, "messages": turn2}).raise_for_status()
        turn3 = follow_up(turn2, answer, "And a moral?")
        key = affinity_key(Kind.CHAT, turn3, None, None)
        keys = client.pd_fleet.memory.known_keys(key, {"model": pd.model, "messages": turn3})
        assert keys
        block = client.pd_options.conversations.block_size
        wait_for(lambda: feeds.held_tokens(a, keys, block) == 0, "A's reset in its events")
        wait_for(lambda: (feeds.held_tokens(b, keys, block) or 0) > 0, "B's blocks in its events")

        answer, t3, hits = ask(turn3)
        cached = answer.usage.prompt_tokens_details.cached_tokens
        assert t3.prefill_url == b and held_of(t3) > 0
        assert hits[b] == cached > 0 and hits[a] == 0, (hits, cached)
        assert held_of(t3) <= cached
        record.append(("turn 3", "B", held_of(t3), cached, hits[b], hits[a]))
    print(
        "\n(turn, prefill, held by its events, the usage's cached, its metrics' hits, the other's) "
        f"per handoff: {record}",
        end="",
    )
