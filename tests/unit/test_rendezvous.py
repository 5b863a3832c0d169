"""The rendezvous policy: the same endpoint for a key in every process, spread over keys, a load bound."""

from __future__ import annotations

import time
from collections import Counter

from pdclient import BreakerSettings
from pdclient.pools import Endpoint
from pdclient.routing import PrefixRendezvous, Rendezvous, RouteRequest, make_policy, rendezvous_order, tenant_key

URLS = [f"http://d{i}:8200/v1" for i in range(3)]


def pool() -> list[Endpoint]:
    return [Endpoint(url, BreakerSettings(), time.monotonic) for url in URLS]


def test_every_process_picks_the_same_endpoint_for_a_key() -> None:
    picks = {Rendezvous().choose(pool(), RouteRequest("decode", affinity_key="k1")).url for _ in range(5)}
    assert len(picks) == 1


def test_keys_spread_over_the_pool() -> None:
    endpoints = pool()
    counts = Counter(
        Rendezvous().choose(endpoints, RouteRequest("decode", affinity_key=f"c{i}")).url for i in range(300)
    )
    assert max(counts.values()) <= 1.2 * 100 and len(counts) == 3


def test_a_key_moves_only_when_its_endpoint_leaves() -> None:
    endpoints = pool()
    before = {f"c{i}": rendezvous_order(endpoints, f"c{i}")[0] for i in range(60)}
    rest = endpoints[1:]
    for key, index in before.items():
        if index != 0:
            assert Rendezvous().choose(rest, RouteRequest("decode", affinity_key=key)) is endpoints[index]


def test_a_tenant_s_keys_hash_apart() -> None:
    assert tenant_key("k", None) == "k" and tenant_key("k", "a") != tenant_key("k", "b")
    endpoints = pool()
    picks = {
        Rendezvous().choose(endpoints, RouteRequest("decode", affinity_key="k", tenant=f"t{i}")).url for i in range(30)
    }
    assert len(picks) > 1


def test_an_endpoint_well_above_the_mean_is_passed_over() -> None:
    endpoints = pool()
    request = RouteRequest("decode", affinity_key="k1")
    first = endpoints[rendezvous_order(endpoints, "k1")[0]]
    for _ in range(2):  # within the slack: it stays
        first.acquire()
    assert Rendezvous().decide(endpoints, request).rule == "key"
    for _ in range(4):
        first.acquire()
    decision = Rendezvous().decide(endpoints, request)
    assert decision.endpoint is not first and (decision.rule, decision.detail) == ("bounded", {"rank": 1})


def test_without_a_key_the_least_loaded() -> None:
    endpoints = pool()
    endpoints[0].acquire()
    decision = Rendezvous().decide(endpoints, RouteRequest("decode"))
    assert decision.rule == "no_key" and decision.endpoint is endpoints[1]


def test_the_registry_names_it() -> None:
    assert isinstance(make_policy("rendezvous"), Rendezvous)


def test_prefix_rendezvous_sends_a_shared_opening_to_one_endpoint() -> None:
    endpoints = pool()
    shared = "<|system|>" + "You answer from the manual. " * 60
    picks = {
        PrefixRendezvous().choose(endpoints, RouteRequest("prefill", prompt_text=f"{shared}<|user|>question {i}")).url
        for i in range(20)
    }
    assert len(picks) == 1
    spread = {
        PrefixRendezvous().choose(endpoints, RouteRequest("prefill", prompt_text=f"<|system|>doc {i}. {shared}")).url
        for i in range(30)
    }
    assert len(spread) == 3
    assert PrefixRendezvous().decide(endpoints, RouteRequest("prefill")).rule == "no_key"
    assert isinstance(make_policy("prefix_rendezvous"), PrefixRendezvous)
