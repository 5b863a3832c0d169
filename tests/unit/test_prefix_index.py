"""The prefix index (bounds, eviction, threads) and the cache-aware policy's rules."""

from __future__ import annotations

import gc
import random
import threading
import tracemalloc
from collections import Counter

import pytest

from pdclient import PDConfigError
from pdclient.pools import BreakerSettings, Endpoint, EndpointPool, route_decision
from pdclient.routing import (
    DEFAULT_MAX_CHARS,
    Affinity,
    CacheAware,
    LoadAware,
    LoadSample,
    PrefixIndex,
    RouteDecision,
    RouteRequest,
    prompt_text,
)

RNG = random.Random(12)


def text(n: int) -> str:
    return RNG.randbytes(n // 2 + 1).hex()[:n]


# -- prompt text ---------------------------------------------------------------------------


def test_prompt_text_is_role_tagged_and_grows_by_prefix() -> None:
    turn1 = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    turn2 = [*turn1, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    first, second = prompt_text({"messages": turn1}), prompt_text({"messages": turn2})
    assert first == "<|system|>Be brief.<|user|>Hi"
    assert second is not None and first is not None and second.startswith(first)
    assert prompt_text({"prompt": "Once upon"}) == "Once upon"
    assert prompt_text({"prompt": [1, 2, 3]}) is None and prompt_text({"messages": []}) is None


def test_prompt_text_of_parts() -> None:
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    other = {"type": "image_url", "image_url": {"url": "data:image/png;base64,BBBB"}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Look: "}, image]}]}
    rendered = prompt_text(body)
    assert rendered is not None and rendered.startswith("<|user|>Look: <|part:")
    body["messages"][0]["content"][1] = other  # type: ignore[index]
    assert prompt_text(body) != rendered, "different images never look alike"


# -- the index ------------------------------------------------------------------------------


def test_match_counts_whole_chunks_from_the_start() -> None:
    index = PrefixIndex(chunk_chars=10, max_chars=1000)
    sent = text(95)
    index.insert(index.hashes(sent), "a")
    assert len(index._lru.get("a", ())) * index.chunk_chars == 90, "9 whole chunks; the partial tail is not indexed"
    longer = sent + text(50)
    assert index.match(index.hashes(longer), ["a", "b"]) == {"a": 90, "b": 0}
    diverging = sent[:35] + "X" + sent[36:]
    assert index.match(index.hashes(diverging), ["a"]) == {"a": 30}, "a chain hash names the whole prefix"
    assert index.match(index.hashes(sent[10:]), ["a"]) == {"a": 0}, "the same chunks elsewhere are not a prefix"


def test_bound_per_key_and_eviction_takes_leaves_before_their_prefixes() -> None:
    index = PrefixIndex(chunk_chars=10, max_chars=100)  # 10 chunks per key
    shared = text(40)
    first = shared + text(40)
    index.insert(index.hashes(first), "a")
    second = shared + text(40)
    index.insert(index.hashes(second), "a")  # 12 chunks wanted: 2 evicted, from first's leaf end
    assert len(index._lru.get("a", ())) * index.chunk_chars == 100
    assert index.match(index.hashes(second), ["a"]) == {"a": 80}
    assert index.match(index.hashes(first), ["a"]) == {"a": 60}, "first lost its last two chunks, not its root"
    for _ in range(5):
        index.insert(index.hashes(shared + text(40)), "a")
    assert index.match(index.hashes(shared), ["a"]) == {"a": 40}, "the shared prefix, touched by all, stays"
    assert len(index._lru.get("b", ())) * index.chunk_chars == 0


def test_forget() -> None:
    index = PrefixIndex(chunk_chars=10)
    index.insert(index.hashes(text(100)), "a")
    index.forget("a")
    assert len(index._lru.get("a", ())) * index.chunk_chars == 0


def test_default_bound_and_its_memory() -> None:
    """The module docstring's figures: ~4 MB for one endpoint when first filled, under
    10 MiB once it keeps evicting."""
    index = PrefixIndex()
    assert index.max_chunks == DEFAULT_MAX_CHARS // 128 == 32768
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(40):
            index.insert(index.hashes(text(128_000)), "a")
        filled = tracemalloc.get_traced_memory()[0] - before
        for _ in range(3):  # three more endpoints' worth of new chunks, each evicting as many
            index.insert([RNG.getrandbits(63) for _ in range(index.max_chunks)], "a")
        churned = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(index._lru.get("a", ())) * index.chunk_chars == DEFAULT_MAX_CHARS
    assert filled < 6_000_000, f"{filled / 1e6:.1f} MB for one full endpoint"
    assert churned < 10 * 2**20, f"{churned / 2**20:.1f} MiB for one full endpoint after churn"


def test_routing_keeps_no_prompt_after_its_call() -> None:
    """16 calls with 4 MiB prompts leave the index behind (its 1024 chunk entries here), and
    nothing of their text."""
    p = EndpointPool("prefill", URLS[:1], Affinity(), BreakerSettings(), lambda: 0.0)
    policy = CacheAware(index=PrefixIndex(chunk_chars=4096))  # the default bound, in fewer, longer chunks
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(16):
            route_decision(p, policy, RouteRequest("prefill", prompt_text=text(4 * 1024 * 1024)))
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(policy.index._lru.get(URLS[0], ())) * policy.index.chunk_chars == DEFAULT_MAX_CHARS
    assert used < 1024 * 1024, f"{used / 2**20:.1f} MiB kept after the calls, for 1024 chunk entries"


def test_a_prompt_longer_than_the_bound_hashes_only_what_an_endpoint_can_hold() -> None:
    index = PrefixIndex(chunk_chars=10, max_chars=100)
    long = text(1000)
    assert index.hashes(long) == index.hashes(long[:100])
    index.insert(index.hashes(long), "a")
    assert index.match(index.hashes(long), ["a"]) == {"a": 100}


def test_threads_share_an_index() -> None:
    index = PrefixIndex(chunk_chars=8, max_chars=8 * 50)
    prompts = [text(200) for _ in range(20)]
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(300):
                p = rng.choice(prompts)
                index.insert(index.hashes(p), f"k{seed % 3}")
                index.match(index.hashes(p), ["k0", "k1", "k2"])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert all(len(index._lru.get(f"k{i}", ())) * index.chunk_chars <= 8 * 50 for i in range(3))


def test_bad_index_settings() -> None:
    with pytest.raises(PDConfigError):
        PrefixIndex(chunk_chars=0)
    with pytest.raises(PDConfigError):
        PrefixIndex(chunk_chars=100, max_chars=10)


# -- the policy -------------------------------------------------------------------------------

URLS = ("http://p1:8000/v1", "http://p2:8000/v1", "http://p3:8000/v1")
SYSTEM = "<|system|>" + text(3000)


def pool() -> EndpointPool:
    return EndpointPool("prefill", URLS, Affinity(), BreakerSettings(), lambda: 0.0)


RULES: Counter[str | None] = Counter()
"""Which rule decided each call() of the current test."""


@pytest.fixture(autouse=True)
def _rules() -> None:
    RULES.clear()


def call(pool: EndpointPool, policy: CacheAware, prompt: str, key: str | None = None) -> Endpoint:
    decision = route_decision(pool, policy, RouteRequest("prefill", affinity_key=key, prompt_text=prompt))
    assert decision.policy == "cache_aware"
    RULES[decision.rule] += 1
    return decision.endpoint


def test_shared_prompt_goes_where_it_was_sent() -> None:
    p, policy = pool(), CacheAware(index=PrefixIndex(chunk_chars=16))
    first = call(p, policy, SYSTEM + "<|user|>hello", key="conv-1")
    new = Affinity().choose(p.endpoints, RouteRequest("prefill", "conv-1"))
    assert first is new, "new prompt: the conversation's affinity choice"
    others = {call(p, policy, SYSTEM + f"<|user|>question {i}", key=f"conv-{i}").url for i in range(2, 30)}
    assert others == {first.url}, "every later conversation with that system prompt follows it"
    assert RULES == {"cache": 28, "affinity": 1}


def test_conversation_turns_stay() -> None:
    p, policy = pool(), CacheAware(index=PrefixIndex(chunk_chars=16))
    history = "<|user|>" + text(400)
    where = call(p, policy, history, key="c")
    for turn in range(5):
        history += "<|assistant|>" + text(200) + "<|user|>" + text(100)
        assert call(p, policy, history, key="c") is where, f"turn {turn}"


def test_below_the_threshold_it_is_a_new_prompt() -> None:
    p, policy = pool(), CacheAware(threshold=0.5, index=PrefixIndex(chunk_chars=16))
    short_system = "<|system|>" + text(300)
    call(p, policy, short_system + "<|user|>a", key="x")
    long_tail = short_system + "<|user|>" + text(1000)  # ~23 % matched
    assert call(p, policy, long_tail, key="y") is Affinity().choose(p.endpoints, RouteRequest("prefill", "y"))
    assert RULES["cache"] == 0


def test_no_key_no_match_means_least_loaded() -> None:
    p, policy = pool(), CacheAware()
    p.endpoints[0].acquire()
    assert call(p, policy, text(50)) is p.endpoints[1]
    assert call(p, policy, None) is p.endpoints[1]  # type: ignore[arg-type]
    assert RULES["least_loaded"] == 2


def test_imbalance_overrides_the_cache() -> None:
    p, policy = (
        pool(),
        CacheAware(balance_abs_threshold=4, balance_rel_threshold=1.5, index=PrefixIndex(chunk_chars=16)),
    )
    hot = call(p, policy, SYSTEM + "<|user|>0", key="k0")
    for _ in range(5):
        hot.acquire()
    cold = min((e for e in p.endpoints if e is not hot), key=lambda e: e.url)
    other = next(e for e in p.endpoints if e not in (hot, cold))
    other.acquire()
    # loads: hot 5, other 1, cold 0: 5 - 0 > 4 and 5 > 1.5 * 0
    assert call(p, policy, SYSTEM + "<|user|>1", key="k1") is cold
    assert RULES["balance"] == 1
    # the balance choice is recorded too: the prompt now matches on cold as well
    matched = policy.index.match(policy.index.hashes(SYSTEM), [e.url for e in p.endpoints])
    assert matched[cold.url] == matched[hot.url] > 0
    hot.release(ok=True)  # 4 - 0 is not > 4: balanced again; the match tie goes to the less loaded
    assert call(p, policy, SYSTEM + "<|user|>2", key="k2") is cold


def test_both_limits_must_be_passed() -> None:
    p, policy = (
        pool(),
        CacheAware(balance_abs_threshold=2, balance_rel_threshold=3.0, index=PrefixIndex(chunk_chars=16)),
    )
    hot = call(p, policy, SYSTEM, key="k")
    for e in p.endpoints:
        e.acquire()
        e.acquire()
    for _ in range(4):
        hot.acquire()
    # loads 6, 2, 2: abs 4 > 2 but 6 is not > 3 * 2
    assert call(p, policy, SYSTEM + "x" * 16, key="k") is hot


def test_load_comes_from_the_servers_when_fresh() -> None:
    p = pool()
    now = [0.0]
    policy = CacheAware(
        balance_abs_threshold=4, load=LoadAware(clock=lambda: now[0]), index=PrefixIndex(chunk_chars=16)
    )
    hot = call(p, policy, SYSTEM, key="k")
    for i, e in enumerate(p.endpoints):
        e.load = LoadSample(0, 20 if e is hot else i, None, taken_at=0, fresh_until=1, local_in_flight=0)
    assert call(p, policy, SYSTEM + "x" * 16, key="k") is not hot, "the servers say it is swamped"
    now[0] = 5.0  # stale: this process sees no load anywhere, so the cache decides again
    holders = {u for u, n in policy.index.match(policy.index.hashes(SYSTEM), URLS).items() if n}
    assert len(holders) == 2 and hot.url in holders
    assert call(p, policy, SYSTEM + "x" * 32, key="k").url in holders
    assert RULES == {"balance": 1, "cache": 1, "affinity": 1}


def test_a_tenant_is_never_routed_by_another_tenants_prompts() -> None:
    p, policy = pool(), CacheAware(index=PrefixIndex(chunk_chars=16))

    def route(tenant: str | None, prompt: str, key: str) -> RouteDecision:
        return route_decision(p, policy, RouteRequest("prefill", key, prompt, tenant))

    first = route("a", SYSTEM + "<|user|>hello", "a-1")
    for i in range(2, 6):
        assert route("a", SYSTEM + f"<|user|>question {i}", f"a-{i}").rule == "cache", "a's own prompts"
    for tenant in ("b", None):
        for i in range(6):
            other = route(tenant, SYSTEM + f"<|user|>question {i}", f"{tenant}-{i}")
            if i == 0:  # its first call: a new prompt, whatever tenant a sent
                assert other.rule == "affinity" and other.detail["match"] == 0, (tenant, str(other))
            else:  # then its own earlier calls, never a's
                assert other.rule == "cache", (tenant, str(other))
    assert [policy.index.hashes(SYSTEM, t) for t in ("a", "b")] != [policy.index.hashes(SYSTEM)] * 2
    assert len({tuple(policy.index.hashes(SYSTEM, t)) for t in ("a", "b", None)}) == 3
    assert route("a", SYSTEM + "<|user|>again", "a-9").endpoint is first.endpoint


def test_bad_policy_settings() -> None:
    with pytest.raises(PDConfigError):
        CacheAware(threshold=1.5)
    with pytest.raises(PDConfigError):
        CacheAware(balance_rel_threshold=0.5)


def test_the_servers_own_events_outrank_what_this_process_sent() -> None:
    """A prompt whose leading ids are known (a remembered conversation's) goes to the
    prefill endpoint whose KV events hold most of them, whatever this process sent where;
    no endpoint holding any of them leaves the text rules to decide."""
    p, policy = pool(), CacheAware(index=PrefixIndex(chunk_chars=16))
    history = "<|user|>" + text(400)
    sent_to = call(p, policy, history, key="c")
    other = next(e for e in p.endpoints if e is not sent_to)
    held = {sent_to.url: 128, other.url: 512}
    decision = route_decision(p, policy, RouteRequest("prefill", "c", history, held_tokens=held))
    assert (decision.endpoint, decision.rule, decision.detail) == (other, "events", {"held": 512})
    # None held anywhere: the text rules decide, as without events.
    nothing = {e.url: 0 for e in p.endpoints}
    assert call_with(p, policy, history, nothing) is sent_to
    assert RULES["cache"] == 1


def call_with(pool: EndpointPool, policy: CacheAware, prompt: str, held: dict[str, int]) -> Endpoint:
    decision = route_decision(pool, policy, RouteRequest("prefill", "c", prompt, held_tokens=held))
    RULES[decision.rule] += 1
    return decision.endpoint
