"""``remote_prefill="auto"`` on the real pair: a follow-up turn goes decode-only and is cached.

The first turn of a conversation (a long, unique system message) goes through a P/D
handoff; its follow-up (the answer sent back and a short question) goes decode-only to
the decode server, whose prefix cache answers most of it; the prefill server gets the
follow-up's prompt as a plain one-token call off the caller's path (``fleet._warm``), so a
later P/D turn prefills only what is new there. The answers are compared with the decode
server's own, never with what the model knows.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import openai

from pdclient import ConversationSettings, Outcome, PDTrace
from pdclient.local import PDServers

from .helpers import GREEDY, WITH_LOGPROBS, metric, same_greedy_answer, tops

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"


def test_an_auto_follow_up_goes_decode_only_and_the_decode_servers_cache_answers_it(
    pd: PDServers, plain: openai.OpenAI
) -> None:
    system = f"Conversation {uuid.uuid4().hex}. " + "Notes: the robot paints in the morning and sleeps at noon. " * 40
    turn1: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Tell me a short story about the robot in the notes."},
    ]
    traces: list[PDTrace] = []
    with pd.client(remote_prefill="auto", on_trace=traces.append) as client:
        stream = client.chat.completions.create(
            model=pd.model, messages=turn1, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
        answer = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Give it a title."}]
        decode_before = {name: metric(pd.decode_url, name) for name in (HITS, QUERIES)}
        prefill_before = metric(pd.prefill_url, QUERIES)
        follow_up = client.chat.completions.create(model=pd.model, messages=turn2, **GREEDY, **WITH_LOGPROBS)
        decode_after = {name: metric(pd.decode_url, name) for name in (HITS, QUERIES)}
        assert follow_up.usage is not None
        warmed = prefill_warmed(pd, prefill_before, follow_up.usage.prompt_tokens)
    first, second = traces
    assert first.outcome is Outcome.DISAGGREGATED and first.forwarded_tokens > 0
    assert (second.outcome, second.remote_prefill, second.conversation) == (
        Outcome.DECODE_ONLY,
        False,
        "extends_answer",
    )
    # Predicted faster, or a trial of decode-only while the endpoint has few timings of it.
    assert second.remote_prefill_reason in ("decode_only_faster", "probe"), second.remote_prefill_reason
    assert second.decode_url == pd.decode_url and second.prefill_url is None
    assert second.prefill_warm_up_url == pd.prefill_url
    assert warmed, "the follow-up's prompt did not reach the prefill server"
    hits = decode_after[HITS] - decode_before[HITS]
    queries = decode_after[QUERIES] - decode_before[QUERIES]
    assert queries > 0 and hits / queries >= 0.7, (hits, queries)
    # What the client estimated as uncached covers what the server did not find cached.
    assert second.estimated_uncached_tokens is not None and second.estimated_uncached_tokens >= queries - hits
    # The decode server's own answer to the same request (its cache is warm either way).
    reference = plain.chat.completions.create(model=pd.model, messages=turn2, **GREEDY, **WITH_LOGPROBS)  # type: ignore[arg-type]
    print("\nthe decode-only follow-up and the decode server's own answer:", end=" ")
    print(same_greedy_answer(tops(follow_up.choices[0].logprobs), tops(reference.choices[0].logprobs)))


def prefill_warmed(pd: PDServers, queries_before: float, prompt_tokens: int, timeout: float = 60.0) -> bool:
    """Whether the prefill server was asked for a prompt of ``prompt_tokens`` (a warm-up) within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if metric(pd.prefill_url, QUERIES) - queries_before >= prompt_tokens:
            return True
        time.sleep(0.1)
    return False


def test_a_p_d_turn_after_a_decode_only_turn_prefills_only_what_is_new(pd: PDServers) -> None:
    """Without the warm-up, the prefill server would hold turn 1's prompt only, and turn 3
    would prefill turn 2 (its answer, its ~100-token message) again."""
    system = f"Conversation {uuid.uuid4().hex}. " + "Notes: the robot paints in the morning and sleeps at noon. " * 40
    detail = "Add this: the robot keeps a red brush, a blue brush and a small ladder in its shed. " * 5
    document = "Appendix: the robot's garden has roses, tulips, daisies and a narrow stone path. " * 25
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Tell me a short story about the robot in the notes."},
    ]
    traces: list[PDTrace] = []
    # The chars-per-token ratio learned from turn 1 already: the ~100-token detail is estimated as such.
    conversations = ConversationSettings(ratio_warmup=1)
    with pd.client(remote_prefill="auto", conversations=conversations, on_trace=traces.append) as client:
        first = client.chat.completions.create(model=pd.model, messages=messages, **GREEDY)
        messages += [
            {"role": "assistant", "content": first.choices[0].message.content},
            {"role": "user", "content": detail},
        ]
        queries_before = metric(pd.prefill_url, QUERIES)
        second = client.chat.completions.create(model=pd.model, messages=messages, **GREEDY)
        assert second.usage is not None and first.usage is not None
        assert prefill_warmed(pd, queries_before, second.usage.prompt_tokens)
        messages += [
            {"role": "assistant", "content": second.choices[0].message.content},
            {"role": "user", "content": document},
        ]
        hits_before = metric(pd.prefill_url, HITS)
        client.chat.completions.create(model=pd.model, messages=messages, **GREEDY)
        hits = metric(pd.prefill_url, HITS) - hits_before
    decided = [(t.outcome, t.estimated_prompt_tokens, t.estimated_uncached_tokens) for t in traces]
    assert [t.outcome for t in traces] == [Outcome.DISAGGREGATED, Outcome.DECODE_ONLY, Outcome.DISAGGREGATED], decided
    block = 128  # vLLM's CPU block size
    assert second.usage.prompt_tokens // block > first.usage.prompt_tokens // block, "turn 2 fills a block of its own"
    # Turn 3's prefill found turn 2's whole prompt (its full blocks) cached, not only turn 1's.
    assert hits >= second.usage.prompt_tokens // block * block, (
        hits,
        first.usage.prompt_tokens,
        second.usage.prompt_tokens,
    )


def test_a_p_d_calls_usage_reports_the_prefill_servers_cache(pd: PDServers) -> None:
    """The caller's usage of a handoff: the prompt side is the prefill's (LocalPD runs
    ``--enable-prompt-tokens-details``). The decode reports 0 ``created_cache_tokens`` on
    the P/D path whatever the prefill cached, so a positive count is the prefill's."""
    system = f"Conversation {uuid.uuid4().hex}. " + "Notes: the robot paints in the morning and sleeps at noon. " * 30
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Say hi."}]
    with pd.client(remote_prefill="always") as client:
        hits_before = metric(pd.prefill_url, HITS)
        stream = client.chat.completions.create(
            model=pd.model, messages=messages, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
        usage = [c.usage for c in stream if c.usage is not None][-1]
        hits = metric(pd.prefill_url, HITS) - hits_before
        json_usage = client.chat.completions.create(model=pd.model, messages=messages, **GREEDY).usage
    assert usage.prompt_tokens_details is not None and json_usage is not None
    assert usage.prompt_tokens_details.cached_tokens == hits
    created = (usage.prompt_tokens_details.model_extra or {}).get("created_cache_tokens")
    assert created is not None and created >= 128, usage
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    # The same prompt again: the prefill server's cache holds its whole blocks now.
    assert json_usage.prompt_tokens_details is not None
    assert json_usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 128 * 128


SHORT_FOLLOW_UPS = ("Give it a title.", "Who is in it?", "Where does it happen?", "How does it end?")


def converse(clients: list[Any], pd: PDServers) -> None:
    """A first turn and four short streamed follow-ups, dealt in turn over ``clients`` (replicas
    that share nothing); the caller never asks for usage and never sees any."""
    system = f"Conversation {uuid.uuid4().hex}. " + "Notes: the robot paints in the morning and sleeps at noon. " * 40
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}, {"role": "user", "content": "A story?"}]
    for i, question in enumerate(("", *SHORT_FOLLOW_UPS)):
        if question:
            messages.append({"role": "user", "content": question})
        chunks = list(
            clients[i % len(clients)].chat.completions.create(model=pd.model, messages=messages, stream=True, **GREEDY)
        )
        assert all(c.usage is None for c in chunks), "pdclient's own usage request reached the caller"
        answer = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        messages.append({"role": "assistant", "content": answer})


def test_every_short_streamed_follow_up_goes_decode_only(pd: PDServers) -> None:
    traces: list[PDTrace] = []
    with pd.client(on_trace=traces.append) as client:
        converse([client], pd)
    assert [t.outcome for t in traces] == [Outcome.DISAGGREGATED] + [Outcome.DECODE_ONLY] * 4, [
        (t.outcome, t.conversation, t.estimated_uncached_tokens) for t in traces
    ]
    # After a decode-only turn the estimate starts from the server's count of its prompt: the
    # partial last block (up to 127 ids) and the new question, not the whole text again.
    estimates = [t.estimated_uncached_tokens for t in traces]
    print("\nestimated uncached tokens per turn:", estimates)
    assert all(e is not None and e < 200 for e in estimates[2:]), estimates


def test_two_clients_alternating_turns_go_decode_only(pd: PDServers) -> None:
    traces: list[PDTrace] = []
    with pd.client(on_trace=traces.append) as a, pd.client(on_trace=traces.append) as b:
        converse([a, b], pd)
    assert [t.outcome for t in traces] == [Outcome.DISAGGREGATED] + [Outcome.DECODE_ONLY] * 4, [
        (t.outcome, t.conversation, t.estimated_uncached_tokens) for t in traces
    ]
    assert {t.decode_url for t in traces} == {traces[0].decode_url}
