"""The conversation memory, its estimates and the remote-prefill decision: no HTTP at all."""

from __future__ import annotations

import gc
import math
import threading
import tracemalloc
from typing import Any

import orjson
import pytest

from pdclient.conversations import (
    Answer,
    AnswerCollector,
    ConversationMemory,
    ConversationSettings,
    Estimate,
    Match,
    Reason,
    decide_remote_prefill,
    rendered_chars,
)
from pdclient.costs import RouteCosts
from pdclient.kv_events import chain_keys, pack
from pdclient.wire import Kind, ParsedEvent, affinity_key

D1 = "http://decode-1:8200/v1"
D2 = "http://decode-2:8200/v1"
ADMITTED = frozenset({D1, D2})
SYSTEM = {"role": "system", "content": "You are terse. " * 50}
USER = {"role": "user", "content": "Tell me a story."}
STORY = "Once upon a time there was a robot who wanted to paint."
FOLLOW_UP = {"role": "user", "content": "Give it a title."}
WEATHER_CALL = {
    "id": "chatcmpl-tool-1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def body(*messages: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), **extra}


def key_of(request: dict[str, Any], session: str | None = None) -> str:
    return affinity_key(Kind.CHAT, request["messages"], None, session)


def memory(**settings: Any) -> ConversationMemory:
    return ConversationMemory(ConversationSettings(**settings))


def new_tokens(mem: ConversationMemory, *messages: dict[str, Any], ratio: float | None = None) -> int:
    """What the memory estimates for new messages, the generation prompt included."""
    return mem.tokens_for(rendered_chars(list(messages)), len(messages) + 1, ratio)


def own(request: dict[str, Any], prompt_tokens: int) -> float:
    """A conversation's own chars per token, from its last prompt."""
    return rendered_chars(request["messages"], request.get("tools")) / prompt_tokens


OWN = own(body(SYSTEM, USER), 1328)


def first_turn(mem: ConversationMemory, *, prompt_tokens: int = 1328, answer_tokens: int = 150) -> dict[str, Any]:
    turn1 = body(SYSTEM, USER)
    mem.remember(key_of(turn1), turn1, Answer(STORY, completion_tokens=answer_tokens), D1, prompt_tokens=prompt_tokens)
    return turn1


# -- extensions -----------------------------------------------------------------------


def test_an_extension_is_uncached_only_in_its_new_messages_and_the_partial_block() -> None:
    # The figures measured on the real pair: a 1328-id prompt, a 150-id answer, block 128:
    # the decode server's prefix cache answered 1408 of the next prompt's ids.
    mem = memory()
    first_turn(mem)
    turn2 = body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP)
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED)
    assert estimate.match is Match.EXTENDS_ANSWER
    assert estimate.endpoint == D1
    assert estimate.cached_tokens == 1408  # floor((1328 + 150 - 1) / 128) * 128
    assert estimate.total_tokens == 1328 + 150 + new_tokens(mem, FOLLOW_UP, ratio=OWN)
    assert estimate.uncached_tokens == estimate.total_tokens - 1408


def test_after_a_p_d_turn_only_the_prompts_whole_blocks_count_as_cached() -> None:
    # Measured on the real pair (bench_conversations, 128-id answers): after a P/D turn of
    # 666 ids and a 128-id answer, the next prompt found 640 cached, not 768.
    mem = memory()
    turn1 = body(SYSTEM, USER)
    answer = Answer(STORY, completion_tokens=128)
    mem.remember(key_of(turn1), turn1, answer, D1, prompt_tokens=666, prompt_pulled=True)
    turn2 = body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP)
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED)
    assert estimate.match is Match.EXTENDS_ANSWER
    assert estimate.cached_tokens == 640
    assert estimate.total_tokens == 666 + 128 + new_tokens(mem, FOLLOW_UP, ratio=own(turn1, 666))


def test_the_answer_may_come_back_as_the_sdk_dumps_it() -> None:
    mem = memory()
    first_turn(mem)
    dumped = {"role": "assistant", "content": STORY, "refusal": None, "tool_calls": None, "audio": None}
    parts = {"role": "assistant", "content": [{"type": "text", "text": STORY}]}
    for answer in (dumped, parts):
        turn2 = body(SYSTEM, USER, answer, FOLLOW_UP)
        assert mem.estimate(key_of(turn2), turn2, ADMITTED).match is Match.EXTENDS_ANSWER


def test_an_edited_answer_keeps_only_the_previous_prompt_cached() -> None:
    mem = memory()
    first_turn(mem)
    for answer in (
        {"role": "assistant", "content": STORY + " The end."},
        {"role": "assistant", "content": STORY, "name": "bot"},  # the template may render the name
    ):
        turn2 = body(SYSTEM, USER, answer, FOLLOW_UP)
        estimate = mem.estimate(key_of(turn2), turn2, ADMITTED)
        assert estimate.match is Match.EXTENDS_PROMPT
        assert estimate.cached_tokens == 1280  # the previous prompt's 10 whole blocks
        assert estimate.total_tokens == 1328 + new_tokens(mem, answer, FOLLOW_UP, ratio=OWN)


def test_an_answer_of_unknown_length_is_not_counted_as_cached() -> None:
    mem = memory()
    first_turn(mem)
    turn1 = body(SYSTEM, USER)
    mem.remember(key_of(turn1), turn1, Answer(STORY), D1, prompt_tokens=1328)  # no usage chunk seen
    turn2 = body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP)
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED)
    assert estimate.match is Match.EXTENDS_ANSWER
    assert estimate.cached_tokens == 1280
    assert estimate.total_tokens == 1328 + mem.tokens_for(len(STORY), 1, OWN) + new_tokens(mem, FOLLOW_UP, ratio=OWN)


def test_a_repeated_call_recomputes_its_last_token() -> None:
    mem = memory(block_size=16)
    turn1 = first_turn(mem, prompt_tokens=64)
    estimate = mem.estimate(key_of(turn1), turn1, ADMITTED)
    assert estimate.match is Match.EXTENDS_PROMPT
    # The prompt is 64 ids, 4 whole blocks, but vLLM computes the last id itself: 3 blocks.
    assert estimate.cached_tokens == 48


def test_a_conversation_grows_turn_by_turn() -> None:
    mem = memory(block_size=16)
    turn1 = first_turn(mem, prompt_tokens=100, answer_tokens=20)
    messages = [*turn1["messages"], {"role": "assistant", "content": STORY}, FOLLOW_UP]
    turn2 = body(*messages)
    assert mem.estimate(key_of(turn2), turn2, ADMITTED).cached_tokens == 112  # floor(119 / 16) * 16
    mem.remember(key_of(turn2), turn2, Answer("A robot's canvas.", completion_tokens=6), D2, prompt_tokens=127)
    turn3 = body(*messages, {"role": "assistant", "content": "A robot's canvas."}, {"role": "user", "content": "Why?"})
    estimate = mem.estimate(key_of(turn3), turn3, ADMITTED)
    assert (estimate.match, estimate.endpoint, estimate.cached_tokens) == (Match.EXTENDS_ANSWER, D2, 128)


# -- tool calls and tool results ------------------------------------------------------


def test_tool_calls_and_their_results_extend_the_conversation() -> None:
    mem = memory()
    turn1 = body(SYSTEM, {"role": "user", "content": "Weather in Paris?"}, tools=TOOLS)
    mem.remember(key_of(turn1), turn1, Answer(None, [WEATHER_CALL], completion_tokens=30), D1, prompt_tokens=700)
    # The caller sends the call back with its arguments serialised its own way, then the result.
    sent_back = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {**WEATHER_CALL, "function": {"name": "get_weather", "arguments": '{"unit":"C","city":"Paris"}'}}
        ],
    }
    result = {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": '{"temp": 21}'}
    turn2 = body(*turn1["messages"], sent_back, result, tools=TOOLS)
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED)
    assert estimate.match is Match.EXTENDS_ANSWER
    # The template renders tool calls its own way: only the prompt's blocks are counted.
    assert estimate.cached_tokens == 640
    answer_chars = rendered_chars([{"tool_calls": [WEATHER_CALL]}])
    ratio = own(turn1, 700)
    assert estimate.total_tokens == 700 + mem.tokens_for(answer_chars, 1, ratio) + new_tokens(mem, result, ratio=ratio)


def test_a_different_tool_call_id_is_not_the_answer() -> None:
    mem = memory()
    turn1 = body(SYSTEM, {"role": "user", "content": "Weather in Paris?"}, tools=TOOLS)
    mem.remember(key_of(turn1), turn1, Answer(None, [WEATHER_CALL], completion_tokens=30), D1, prompt_tokens=700)
    other = {"role": "assistant", "tool_calls": [{**WEATHER_CALL, "id": "call-2"}]}
    turn2 = body(*turn1["messages"], other, {"role": "tool", "tool_call_id": "call-2", "content": "21"}, tools=TOOLS)
    assert mem.estimate(key_of(turn2), turn2, ADMITTED).match is Match.EXTENDS_PROMPT


def test_a_different_tool_list_starts_afresh() -> None:
    mem = memory()
    turn1 = body(SYSTEM, USER, tools=TOOLS)
    mem.remember(key_of(turn1), turn1, Answer(STORY, completion_tokens=10), D1, prompt_tokens=900)
    for changed in ({"tools": [*TOOLS, {"type": "function", "function": {"name": "other"}}]}, {"tools": None}, {}):
        turn2 = {**body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP), **changed}
        estimate = mem.estimate(key_of(turn2), turn2, ADMITTED)
        assert (estimate.match, estimate.cached_tokens, estimate.endpoint) == (Match.RESHAPED, 0, None)
    turn2 = body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP, tools=TOOLS, tool_choice="none")
    assert mem.estimate(key_of(turn2), turn2, ADMITTED).match is Match.RESHAPED


# -- everything else is wholly uncached -----------------------------------------------


def test_an_edit_of_an_earlier_message_is_wholly_uncached() -> None:
    mem = memory()
    first_turn(mem)
    edited = body(SYSTEM, {"role": "user", "content": "Tell me a long story."})
    session = "user-42"  # an explicit session key: the edit does not change the key
    mem.remember(key_of(edited, session), body(SYSTEM, USER), Answer(STORY, completion_tokens=9), D1, prompt_tokens=9)
    estimate = mem.estimate(key_of(edited, session), edited, ADMITTED)
    assert (estimate.match, estimate.uncached_tokens, estimate.endpoint) == (Match.EDITED, estimate.total_tokens, None)


def test_a_changed_system_prompt_is_wholly_uncached() -> None:
    mem = memory()
    first_turn(mem)
    changed = body(
        {"role": "system", "content": "Be verbose."}, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP
    )
    # Without a session the key is the conversation's opening: a new conversation.
    assert mem.estimate(key_of(changed), changed, ADMITTED).match is Match.UNKNOWN
    session_turn = body(SYSTEM, USER)
    mem.remember(key_of(session_turn, "s"), session_turn, Answer(STORY), D1, prompt_tokens=1328)
    estimate = mem.estimate(key_of(changed, "s"), changed, ADMITTED)
    assert (estimate.match, estimate.cached_tokens) == (Match.EDITED, 0)


def test_a_shortened_conversation_is_wholly_uncached() -> None:
    mem = memory()
    turn1 = body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP)
    mem.remember(key_of(turn1, "s"), turn1, Answer("Title"), D1, prompt_tokens=1500)
    shorter = body(SYSTEM, USER)
    assert mem.estimate(key_of(shorter, "s"), shorter, ADMITTED).match is Match.EDITED


def test_an_unknown_conversation_is_wholly_uncached() -> None:
    mem = memory()
    request = body(SYSTEM, USER)
    estimate = mem.estimate(key_of(request), request, ADMITTED)
    assert estimate == Estimate(new_tokens(mem, SYSTEM, USER), new_tokens(mem, SYSTEM, USER), None, Match.UNKNOWN)


def test_a_conversation_whose_decode_endpoint_is_not_admitted_is_wholly_uncached() -> None:
    mem = memory()
    first_turn(mem)
    turn2 = body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP)
    for admitted in (frozenset({D2}), frozenset()):
        estimate = mem.estimate(key_of(turn2), turn2, admitted)
        assert (estimate.match, estimate.cached_tokens, estimate.endpoint) == (Match.ENDPOINT_UNAVAILABLE, 0, None)


def test_an_unknown_prompt_length_counts_only_what_was_known_cached() -> None:
    mem = memory()
    turn1 = body(SYSTEM, USER)
    mem.remember(key_of(turn1), turn1, Answer(STORY), D1, prompt_tokens=None, cached_floor=1300)
    turn2 = body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP)
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED)
    assert (estimate.match, estimate.cached_tokens) == (Match.EXTENDS_ANSWER, 1280)
    assert estimate.total_tokens == max(new_tokens(mem, *turn2["messages"]), 1281)  # no ratio of its own


def test_estimates_never_count_more_cached_than_the_prompt_minus_one() -> None:
    mem = memory(block_size=1)
    turn1 = first_turn(mem, prompt_tokens=10, answer_tokens=5)
    turn2 = body(*turn1["messages"], {"role": "assistant", "content": STORY})
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED)
    assert 1 <= estimate.uncached_tokens <= estimate.total_tokens


# -- the memory's bounds --------------------------------------------------------------


def test_the_memory_keeps_the_most_recently_used_conversations() -> None:
    mem = memory(max_conversations=3)
    turns = [body({"role": "user", "content": f"conversation {i}"}) for i in range(4)]
    for turn in turns[:3]:
        mem.remember(key_of(turn), turn, Answer("ok", completion_tokens=1), D1, prompt_tokens=10)
    mem.estimate(key_of(turns[0]), turns[0], ADMITTED)  # a use: conversation 0 is now the most recent
    mem.remember(key_of(turns[3]), turns[3], Answer("ok", completion_tokens=1), D1, prompt_tokens=10)
    assert len(mem) == 3
    matches = [mem.estimate(key_of(t), t, ADMITTED).match for t in turns]
    assert matches == [Match.EXTENDS_PROMPT, Match.UNKNOWN, Match.EXTENDS_PROMPT, Match.EXTENDS_PROMPT]


def test_an_entry_costs_the_same_few_hundred_bytes_whatever_the_conversation() -> None:
    """The ceiling the module docstring states: 10,000 conversations in under 4 MB, after
    the LRU has churned, each entry made of objects of its own as a live client's are."""
    long_history = [SYSTEM] + [{"role": "user", "content": "x" * 2000}] * 100  # ~200 kB of messages
    mem = memory()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(15_000):  # past the bound by half: the LRU table at its churned size
            messages = long_history if i % 500 == 0 else [SYSTEM, {"role": "user", "content": f"question {i}"}]
            turn = {"model": "m", "messages": messages, "tools": TOOLS}
            endpoint = f"http://decode-{i % 4}:8200/v1"  # a new string each time, as from a parsed header
            answer = Answer(f"{STORY} {i}", completion_tokens=300 + i)
            mem.remember(f"session:{i}", turn, answer, endpoint, prompt_tokens=123_456 + i, cached_floor=1000 + i)
        del messages, turn, endpoint, answer
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(mem) == 10_000
    assert used / 10_000 < 400, f"{used / 10_000:.0f} bytes per conversation"  # ~340 measured


def test_a_remembered_turn_reads_back_as_it_was_given() -> None:
    mem = memory()
    turn1 = body(SYSTEM, USER)
    huge = 2**70  # a server's absurd count must not break the memory
    mem.remember(key_of(turn1), turn1, Answer(STORY, completion_tokens=huge), D1, prompt_tokens=None, cached_floor=-3)
    unknown = mem.estimate(key_of(turn1), body(SYSTEM, USER, {"role": "assistant", "content": STORY}), ADMITTED)
    assert unknown.match is Match.EXTENDS_ANSWER and unknown.endpoint == D1
    assert unknown.cached_tokens == 0, "no prompt length and no floor: nothing known cached"
    first_turn(mem)
    follow_up = body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP)
    estimate = mem.estimate(key_of(follow_up), follow_up, ADMITTED)
    assert estimate.total_tokens == 1328 + 150 + new_tokens(mem, FOLLOW_UP, ratio=OWN)
    assert estimate.cached_tokens == (1328 + 150 - 1) // 128 * 128


def test_memory_is_safe_under_threads() -> None:
    mem = memory(max_conversations=50)
    errors: list[BaseException] = []

    def work(worker: int) -> None:
        try:
            for i in range(300):
                turn = body({"role": "user", "content": f"{worker}-{i % 70}"})
                mem.remember(key_of(turn), turn, Answer("a", completion_tokens=1), D1, prompt_tokens=10)
                mem.learn(turn, 10)
                mem.estimate(key_of(turn), turn, ADMITTED)
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(mem) == 50


# -- the chars-per-token ratio --------------------------------------------------------


def sample(chars: int) -> dict[str, Any]:
    """A call whose messages render to ``chars`` characters ("user" is four of them)."""
    return body({"role": "user", "content": "a" * (chars - 4)})


def test_the_ratio_is_learned_from_the_first_count_with_a_margin_until_warm() -> None:
    mem = memory(ratio_warmup=4, initial_chars_per_token=2.0)
    assert mem.chars_per_token == 2.0  # no server count yet
    for _ in range(3):
        mem.learn(sample(4000), 1000)  # 4 chars per token, as English text is
        assert mem.chars_per_token == pytest.approx(4.0 * 0.8)  # not warm: 25 % more tokens
    mem.learn(sample(4000), 1000)
    assert mem.chars_per_token == pytest.approx(4.0)
    assert mem.tokens_for(400, 1) == 100 + 8


def test_a_ratio_below_the_initial_one_is_used_at_once() -> None:
    mem = memory(ratio_warmup=4, initial_chars_per_token=2.0)
    mem.learn(sample(1500), 1000)  # CJK-like text: fewer chars than tokens would allow
    assert mem.chars_per_token == pytest.approx(1.5 * 0.8)


def test_a_conversations_own_ratio_is_capped_by_the_learned_one_until_warm() -> None:
    mem = memory(ratio_warmup=4)
    assert mem.tokens_for(600, 0, own_ratio=6.0) == 300  # no count yet: the initial 2.0 caps it
    mem.learn(sample(6000), 1000)
    assert mem.tokens_for(600, 0, own_ratio=6.0) == 125  # 6.0 learned, 4.8 with the margin
    assert mem.tokens_for(600, 0, own_ratio=3.0) == 200  # its own text is denser: its own


def test_the_ratio_follows_recent_samples_weighted_by_tokens() -> None:
    mem = memory(ratio_warmup=1, ratio_window=4)
    for _ in range(4):
        mem.learn(sample(2000), 1000)
    mem.learn(sample(25_000), 10_000)  # one long prompt at 2.5 chars per token
    assert mem.chars_per_token == pytest.approx((3 * 2000 + 25_000) / (3 * 1000 + 10_000))


def test_the_ratio_counts_what_the_template_renders() -> None:
    call = {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]}
    tool = {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": [{"type": "text", "text": "21"}]}
    assert (
        rendered_chars([call, tool])
        == len("assistant")
        + len(
            b'[{"function":{"arguments":"{\\"city\\": \\"Paris\\", \\"unit\\": \\"C\\"}","name":"get_weather"},'
            b'"id":"chatcmpl-tool-1","type":"function"}]'
        )
        + len("tool")
        + len("chatcmpl-tool-1")
        + 2
    )
    assert rendered_chars([USER], TOOLS) > rendered_chars([USER])


def test_each_conversation_is_estimated_with_its_own_ratio() -> None:
    mem = memory(ratio_warmup=1)
    for _ in range(4):
        mem.learn(sample(4000), 1000)  # the client's traffic: English, 4 chars per token
    english = body({"role": "user", "content": "a" * 396})
    chinese = body({"role": "user", "content": "你" * 396})  # 400 chars, 800 ids: 0.5 chars per token
    mem.remember(key_of(english), english, Answer("ok", completion_tokens=2), D1, prompt_tokens=100)
    mem.remember(key_of(chinese), chinese, Answer("好", completion_tokens=2), D1, prompt_tokens=800)
    question = {"role": "user", "content": "x" * 100}
    totals = {}
    for name, turn in (("english", english), ("chinese", chinese)):
        answer = {"role": "assistant", "content": "ok" if name == "english" else "好"}
        follow = body(*turn["messages"], answer, question)
        totals[name] = mem.estimate(key_of(follow), follow, ADMITTED).total_tokens
    assert totals["english"] == 100 + 2 + math.ceil(104 / 4.0) + 16
    assert totals["chinese"] == 800 + 2 + math.ceil(104 / 0.5) + 16


def test_samples_without_text_or_ids_are_ignored() -> None:
    mem = memory(ratio_warmup=1)
    mem.learn(body(), 100)
    mem.learn(sample(100), 0)
    mem.learn({"prompt": "not chat"}, 100)
    assert mem.chars_per_token == 2.0


# -- what one call may teach ----------------------------------------------------------


def test_fields_the_server_never_hands_the_template_are_not_counted() -> None:
    plain = {"role": "user", "content": "Summarize this."}
    padded = {**plain, "metadata": "x" * 1_000_000, "extra": {"blob": "y" * 1000}}
    assert rendered_chars([padded]) == rendered_chars([plain])
    call = {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]}
    padded_call = {**call, "tool_calls": [{**WEATHER_CALL, "trace": "z" * 1000}]}
    assert rendered_chars([padded_call]) == rendered_chars([call])
    assert rendered_chars([plain], [{**TOOLS[0], "x-note": "w" * 1000}]) == rendered_chars([plain], TOOLS)
    # What vLLM does hand the template is counted: a name, reasoning.
    assert rendered_chars([{**plain, "name": "ann"}]) == rendered_chars([plain]) + 3
    assert rendered_chars([{**call, "reasoning": "hmm"}]) == rendered_chars([call]) + 3


def test_a_call_padded_with_fields_no_template_renders_teaches_its_true_ratio() -> None:
    mem = memory(ratio_warmup=1)
    for _ in range(10):
        mem.learn(body({"role": "user", "content": "a" * 3996, "metadata": "x" * 1_000_000}), 1000)
    assert mem.chars_per_token == pytest.approx(4.0)


def test_one_tenants_counts_never_move_anothers_ratio() -> None:
    mem, alone = memory(ratio_warmup=1), memory(ratio_warmup=1)
    for m in (mem, alone):
        m.learn(sample(4000), 1000, tenant="b")
    for i in range(10):
        mem.learn(sample(8000 - 100 * i), 1000, tenant="a")
        mem.learn(sample(1000), 1000)  # the tenant of a client in process (none)
    assert mem.tenant_chars_per_token("b") == alone.tenant_chars_per_token("b") == pytest.approx(4.0)
    assert mem.tenant_chars_per_token("a") != pytest.approx(4.0)
    call = body(SYSTEM, USER, {"role": "assistant", "content": STORY}, {"role": "user", "content": "x" * 6000})
    assert mem.estimate("k", call, ADMITTED, D1, tenant="b") == alone.estimate("k", call, ADMITTED, D1, tenant="b")
    assert mem.tokens_for(4000, 0, tenant="b") == 1000
    # A tenant nothing was learned from starts from the initial guess, whatever others taught.
    assert mem.tenant_chars_per_token("c") == mem.settings.initial_chars_per_token


def test_the_learned_ratio_stays_within_what_tokenizers_give() -> None:
    high, low = memory(ratio_warmup=1), memory(ratio_warmup=1)
    high.learn(sample(1_000_000), 10)
    low.learn(sample(10), 100_000)
    assert (low.chars_per_token, high.chars_per_token) == (0.5, 8.0)
    # A conversation's own ratio too: its next turn's text is never read as fewer tokens.
    turn1 = body({"role": "user", "content": "a" * 100_000})
    high.remember(key_of(turn1), turn1, Answer("ok", completion_tokens=2), D1, prompt_tokens=10)
    follow = body(*turn1["messages"], {"role": "assistant", "content": "ok"}, {"role": "user", "content": "b" * 8000})
    assert high.estimate(key_of(follow), follow, ADMITTED).total_tokens >= 10 + 2 + 8000 / 8


def test_one_count_moves_the_learned_ratio_by_a_quarter_at_most() -> None:
    mem = memory(ratio_warmup=1)
    for _ in range(8):
        mem.learn(sample(4000), 1000)
    mem.learn(sample(800_000), 100_000)  # one long prompt read at 8 chars per token
    assert mem.chars_per_token == pytest.approx(5.0)
    mem.learn(sample(10_000), 100_000)  # and one at 0.1
    assert mem.chars_per_token == pytest.approx(4.0)


def test_a_call_with_media_teaches_no_ratio() -> None:
    mem = memory(ratio_warmup=1)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 1_000_000}}
    mem.learn(body({"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}), 1500)
    assert mem.chars_per_token == mem.settings.initial_chars_per_token


# -- decide ---------------------------------------------------------------------------

SETTINGS = ConversationSettings(max_uncached_ratio=0.7)


def estimate_of(total: int, uncached: int, endpoint: str | None = D1) -> Estimate:
    return Estimate(total, uncached, endpoint, Match.EXTENDS_ANSWER)


@pytest.mark.parametrize(
    ("mode", "estimate", "remote", "reason"),
    [
        ("always", estimate_of(1500, 10), True, Reason.MODE_ALWAYS),
        ("never", estimate_of(1500, 1500, None), False, Reason.MODE_NEVER),
        # Without costs, the priors: the two routes' first tokens meet at 256 uncached tokens.
        ("auto", estimate_of(1500, 87), False, Reason.DECODE_ONLY_FASTER),
        ("auto", estimate_of(1500, 255), False, Reason.DECODE_ONLY_FASTER),
        ("auto", estimate_of(1500, 256), True, Reason.HANDOFF_FASTER),
        ("auto", estimate_of(200, 140), True, Reason.UNCACHED_RATIO_AT_OR_ABOVE),  # short and mostly new
        ("auto", estimate_of(30, 30, None), True, Reason.UNCACHED_RATIO_AT_OR_ABOVE),  # a new short conversation
        ("auto", None, True, Reason.NO_ESTIMATE),
    ],
)
def test_decide(mode: str, estimate: Estimate | None, remote: bool, reason: Reason) -> None:
    decision = decide_remote_prefill(mode, estimate, SETTINGS)
    assert (decision.remote_prefill, decision.reason) == (remote, reason)
    assert decision.decode_endpoint == (estimate.endpoint if estimate else None)
    assert decision.reason.value == reason.value and isinstance(decision.reason.value, str)


def test_decide_with_the_ratio_condition_off_sends_short_new_prompts_decode_only() -> None:
    settings = ConversationSettings(max_uncached_ratio=1.0)
    decision = decide_remote_prefill("auto", estimate_of(30, 30, None), settings)
    assert (decision.remote_prefill, decision.reason, decision.estimate) == (
        True,
        Reason.UNCACHED_RATIO_AT_OR_ABOVE,
        estimate_of(30, 30, None),
    )
    assert not decide_remote_prefill("auto", estimate_of(30, 29, None), settings).remote_prefill


ANSWER_MS = 1500.0
"""The streams' answer time the cost model's prior gives: a tenth of it is a 150 ms budget."""


def costs(decode_only_ms: float, handoff_ms: float, stall_ms: float = 0.0, streams: int = 0) -> RouteCosts:
    return RouteCosts(decode_only_ms, handoff_ms, stall_ms, stall_ms, streams, ANSWER_MS)


@pytest.mark.parametrize(
    ("route_costs", "remote", "reason"),
    [
        (costs(494.0, 1334.0), False, Reason.DECODE_ONLY_FASTER),  # the CPU pair: a handover dearer than 300 tokens
        (costs(494.0, 1334.0, stall_ms=400.0, streams=1), True, Reason.STALL_OVER_BUDGET),
        (costs(494.0, 1334.0, stall_ms=150.0, streams=1), False, Reason.DECODE_ONLY_FASTER),  # at the budget
        (costs(900.0, 300.0), True, Reason.HANDOFF_FASTER),
        (costs(300.0, 300.0), True, Reason.HANDOFF_FASTER),  # a tie spares the decode's streams
    ],
)
def test_auto_takes_the_faster_route_within_the_stall_budget(
    route_costs: RouteCosts, remote: bool, reason: Reason
) -> None:
    decision = decide_remote_prefill("auto", estimate_of(5000, 300), SETTINGS, route_costs)
    assert (decision.remote_prefill, decision.reason, decision.costs) == (remote, reason, route_costs)


def test_the_stall_budget_and_a_fixed_cap_are_the_operators() -> None:
    cheap = costs(10.0, 1000.0, stall_ms=20.0, streams=4)
    strict = ConversationSettings(max_decode_stall_ms=0)
    assert decide_remote_prefill("auto", estimate_of(5000, 20), strict, cheap).reason is Reason.STALL_OVER_BUDGET
    capped = ConversationSettings(threshold_tokens=256)
    decision = decide_remote_prefill("auto", estimate_of(5000, 300), capped, cheap)
    assert (decision.remote_prefill, decision.reason) == (True, Reason.UNCACHED_AT_OR_ABOVE_THRESHOLD)


@pytest.mark.parametrize(
    ("answer_ms", "remote", "reason"),
    [
        (1500.0, True, Reason.STALL_OVER_BUDGET),  # 150 ms of budget: a 400 ms stall is over it
        (5000.0, False, Reason.DECODE_ONLY_FASTER),  # slower streams (an AVX2 CPU): 500 ms of budget
    ],
)
def test_the_stall_budget_is_a_share_of_the_streams_answer_time(answer_ms: float, remote: bool, reason: Reason) -> None:
    stalling = RouteCosts(400.0, 1000.0, 400.0, 380.0, 1, answer_ms)
    decision = decide_remote_prefill("auto", estimate_of(5000, 300), SETTINGS, stalling)
    assert (decision.remote_prefill, decision.reason, decision.stall_budget_ms) == (remote, reason, answer_ms / 10)
    fixed = ConversationSettings(max_decode_stall_ms=150.0)
    assert decide_remote_prefill("auto", estimate_of(5000, 300), fixed, stalling).stall_budget_ms == 150.0


@pytest.mark.parametrize(
    ("charged_ms", "remote", "reason"),
    [
        (0.0, False, Reason.DECODE_ONLY_FASTER),
        (50.0, False, Reason.DECODE_ONLY_FASTER),  # 50 + 100 ms: at the 150 ms budget
        (60.0, True, Reason.STALL_OVER_BUDGET),  # what the turns before it stalled the streams counts too
    ],
)
def test_the_stall_budget_counts_what_the_running_streams_were_already_charged(
    charged_ms: float, remote: bool, reason: Reason
) -> None:
    stalling = RouteCosts(100.0, 1000.0, 100.0, 90.0, 1, ANSWER_MS, charged_ms)
    decision = decide_remote_prefill("auto", estimate_of(5000, 100), SETTINGS, stalling)
    assert (decision.remote_prefill, decision.reason) == (remote, reason)
    # A stream over its budget already is not stalled by a turn that stalls nothing.
    idle = RouteCosts(100.0, 1000.0, 0.0, 90.0, 0, ANSWER_MS, 500.0)
    assert decide_remote_prefill("auto", estimate_of(5000, 100), SETTINGS, idle).reason is Reason.DECODE_ONLY_FASTER


def test_a_probe_tries_decode_only_only_within_the_budget() -> None:
    asked: list[bool] = []

    def due() -> bool:
        asked.append(True)
        return True

    slower = RouteCosts(300.0, 100.0, 0.0, 100.0, 0, ANSWER_MS)
    decision = decide_remote_prefill("auto", estimate_of(5000, 100), SETTINGS, slower, due)
    assert (decision.remote_prefill, decision.reason) == (False, Reason.PROBE)
    # A compute beyond the budget (were streams to start) is never a trial, nor asked for one.
    long = RouteCosts(900.0, 300.0, 0.0, 800.0, 0, ANSWER_MS)
    assert decide_remote_prefill("auto", estimate_of(5000, 800), SETTINGS, long, due).reason is Reason.HANDOFF_FASTER
    faster = RouteCosts(50.0, 300.0, 0.0, 40.0, 0, ANSWER_MS)
    assert (
        decide_remote_prefill("auto", estimate_of(5000, 40), SETTINGS, faster, due).reason is Reason.DECODE_ONLY_FASTER
    )
    assert len(asked) == 1
    assert decide_remote_prefill("auto", estimate_of(5000, 100), SETTINGS, slower, lambda: False).remote_prefill


def test_answers_that_take_no_time_do_not_stop_decode_only_from_being_tried() -> None:
    """Answers of ~1 ms (one token, a stub's) make a tenth of them no budget at all; a trial
    is still bounded by the budget a fleet starts with (a tenth of the prior's 1.5 s)."""
    instant = RouteCosts(300.0, 100.0, 0.0, 100.0, 0, 1.0)
    decision = decide_remote_prefill("auto", estimate_of(5000, 100), SETTINGS, instant, lambda: True)
    assert (decision.remote_prefill, decision.reason, decision.stall_budget_ms) == (False, Reason.PROBE, 0.1)
    long = RouteCosts(900.0, 300.0, 0.0, 800.0, 0, 1.0)
    assert decide_remote_prefill("auto", estimate_of(5000, 800), SETTINGS, long, lambda: True).remote_prefill
    # Streams running on such a decode still get the learnt budget: a handoff.
    streaming = RouteCosts(50.0, 300.0, 50.0, 40.0, 2, 1.0)
    assert decide_remote_prefill("auto", estimate_of(5000, 40), SETTINGS, streaming).reason is Reason.STALL_OVER_BUDGET


def test_media_and_a_missing_estimate_are_handoffs_whatever_the_costs() -> None:
    media = Estimate(5000, 20, D1, Match.EXTENDS_ANSWER, adds_media=True)
    assert decide_remote_prefill("auto", media, SETTINGS, costs(1.0, 1000.0)).reason is Reason.ADDS_MEDIA
    assert decide_remote_prefill("auto", None, SETTINGS, costs(1.0, 1000.0)).reason is Reason.NO_ESTIMATE


def test_decide_refuses_an_unknown_mode() -> None:
    with pytest.raises(ValueError, match="remote_prefill must be one of"):
        decide_remote_prefill("sometimes", None, SETTINGS)


def test_the_defaults_decide_the_measured_follow_up_decode_only() -> None:
    mem = memory()
    first_turn(mem)
    turn2 = body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP)
    decision = decide_remote_prefill("auto", mem.estimate(key_of(turn2), turn2, ADMITTED), mem.settings)
    assert (decision.remote_prefill, decision.reason, decision.decode_endpoint) == (
        False,
        Reason.DECODE_ONLY_FASTER,
        D1,
    )


MEDIA_PARTS = [
    {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
    {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
    {"type": "video_url", "video_url": {"url": "https://example.com/clip.mp4"}},
    {"type": "file", "file": {"file_id": "file-1"}},
    {"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}},
    {"image_url": "https://example.com/cat.png"},  # vLLM reads a part without a type by its keys
    42,  # not a part at all: unsure is media (the prefill server says what is wrong with it)
]


@pytest.mark.parametrize("part", MEDIA_PARTS)
def test_a_follow_up_that_adds_media_is_a_handoff(part: object) -> None:
    """An image by URL is ~35 tokens of JSON and hundreds of the server's: never decode-only."""
    mem = memory()
    first_turn(mem)
    question = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}
    turn2 = body(SYSTEM, USER, {"role": "assistant", "content": STORY}, question)
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED)
    decision = decide_remote_prefill("auto", estimate, mem.settings)
    assert (decision.remote_prefill, decision.reason.value, decision.decode_endpoint) == (True, "adds_media", D1)
    assert estimate.match is Match.EXTENDS_ANSWER and estimate.adds_media
    assert estimate.uncached_tokens < 256, "by its JSON alone it would have gone decode-only"


def test_media_already_in_the_conversation_and_text_parts_add_none() -> None:
    mem = memory()
    image = {"role": "user", "content": [{"type": "text", "text": "Describe it."}, MEDIA_PARTS[0]]}
    turn1 = body(SYSTEM, image)
    mem.remember(key_of(turn1), turn1, Answer(STORY, completion_tokens=150), D1, prompt_tokens=1900)
    texts = [
        {"type": "text", "text": "Shorter, please."},
        {"type": "input_text", "text": " And a title."},
        {"type": "refusal", "refusal": ""},
        {"text": " Thanks."},
        "!",
    ]
    turn2 = body(SYSTEM, image, {"role": "assistant", "content": STORY}, {"role": "user", "content": texts})
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED)
    assert not estimate.adds_media, "the image is in the cached prefix; only text is new"
    assert decide_remote_prefill("auto", estimate, mem.settings).reason is Reason.DECODE_ONLY_FASTER


def test_media_counts_whatever_the_previous_prompt_length() -> None:
    mem = memory()
    turn1 = body(SYSTEM, USER)
    mem.remember(key_of(turn1), turn1, Answer(STORY), D1, prompt_tokens=None, cached_floor=1280)
    turn2 = body(SYSTEM, USER, {"role": "user", "content": [MEDIA_PARTS[2]]})
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED)
    assert estimate.match is Match.EXTENDS_PROMPT and estimate.adds_media
    assert decide_remote_prefill("auto", estimate, mem.settings).reason is Reason.ADDS_MEDIA


@pytest.mark.parametrize(
    "settings",
    [
        {"threshold_tokens": -1},
        {"threshold_tokens": 2.5},
        {"max_decode_stall_ms": -1},
        {"max_decode_stall_ms": math.nan},
        {"max_decode_stall_ms": math.inf},
        {"max_decode_stall_ms": "100"},
        {"max_decode_stall_share": -0.1},
        {"max_decode_stall_share": 1.5},
        {"max_decode_stall_share": math.nan},
        {"max_decode_stall_share": True},
        {"max_uncached_ratio": 0.0},
        {"max_uncached_ratio": 1.5},
        {"max_uncached_ratio": math.nan},
        {"block_size": 0},
        {"max_conversations": 0},
        {"ratio_window": 0},
        {"initial_chars_per_token": 0.0},
        {"overhead_tokens_per_message": -1},
    ],
)
def test_settings_are_checked(settings: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        ConversationSettings(**settings)


# -- the answer the caller received -----------------------------------------------------


def sse(*chunks: dict[str, Any]) -> bytes:
    import json

    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0) -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}


def collect(data: bytes, *, stream: bool = True, split: int = 7) -> AnswerCollector:
    """The collector fed as a call's decode body feeds it: the bytes as they came."""
    collector = AnswerCollector(stream=stream)
    for at in range(0, len(data), split):  # events cut anywhere, as the network does
        collector.feed(data[at : at + split])
    return collector


def test_a_streamed_answer_is_assembled_from_its_events() -> None:
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3}}
    data = sse(
        chunk({"role": "assistant", "content": ""}),
        chunk({"content": "Once "}),
        chunk({"content": "upon"}),
        chunk({}, "stop"),
        usage,
    )
    collector = collect(data)
    assert collector.answer() == Answer("Once upon", (), 3, False)
    assert collector.prompt_tokens == 40
    assert collect(data.replace(b"\n", b"\r\n")).answer() == Answer("Once upon", (), 3, False)


def test_a_long_streamed_answer_is_read_in_batches_with_its_usage_after_the_finish() -> None:
    words = [f"word{i} " for i in range(3000)]  # ~300 kB of events: several batches
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 3000}}
    data = sse(*[chunk({"content": w}) for w in words], chunk({}, "length"), usage)
    for split in (7, 4096, 65537):
        collector = collect(data, split=split)
        assert collector.answer() == Answer("".join(words), (), 3000, False)
        assert collector.answer() == Answer("".join(words), (), 3000, False)  # asked again: the same
        assert collector.prompt_tokens == 40


def test_events_a_step_parsed_are_not_parsed_again_and_keep_their_order() -> None:
    events = [b"data: " + orjson.dumps(chunk({"content": c})) + b"\n\n" for c in ("a", "b", "c")]
    done = b"data: " + orjson.dumps(chunk({}, "stop")) + b"\n\n"

    def parsed(event: bytes, content: str) -> ParsedEvent:
        return ParsedEvent(event, chunk({"content": content}))

    collector = AnswerCollector(stream=True)
    collector.feed_events([ParsedEvent(b": comment\n\n", None)])  # no data: nothing to read
    collector.feed_events([parsed(events[0], "A")])  # its payload is read, not its bytes
    collector.feed(events[1])
    # Bytes wait to be read: an event after them is read after them, from its bytes.
    collector.feed_events([parsed(events[2], "C"), done])
    assert collector.answer() == Answer("Abc", (), None, False)


def test_a_streamed_tool_call_is_assembled() -> None:
    first = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    data = sse(
        chunk({"role": "assistant", "tool_calls": [first]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
        chunk({}, "tool_calls"),
    )
    answer = collect(data).answer()
    assert answer is not None and answer.content is None
    assert answer.tool_calls == (
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
    )


def test_an_unfinished_or_ambiguous_answer_is_none() -> None:
    assert collect(sse(chunk({"content": "Once"}))).answer() is None  # cut before its finish
    assert collect(sse(chunk({"content": "a"}), chunk({"content": "b"}, "stop", index=1))).answer() is None  # n > 1
    assert collect(b"data: {not json\n\n").answer() is None
    reasoning = collect(sse(chunk({"reasoning_content": "hm"}), chunk({"content": "x"}, "stop"))).answer()
    assert reasoning is not None and reasoning.reasoning


ODD_EVENTS = {
    "plain": [
        b'{"choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null}]}',
        b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}',
    ],
    "usage chunk": [
        b'{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}',
        b'{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":1,"prompt_tokens_details":{"cached_tokens":4}}}',
    ],
    "odd usage": [
        b'{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}],"usage":{"prompt_tokens":-1,"completion_tokens":"2"}}'
    ],
    "second choice": [b'{"choices":[{"index":1,"delta":{"content":"a"},"finish_reason":"stop"}]}'],
    "index null": [b'{"choices":[{"index":null,"delta":{"content":"a"},"finish_reason":"stop"}]}'],
    "delta not an object": [b'{"choices":[{"delta":"a","finish_reason":"stop"}]}'],
    "content not text": [b'{"choices":[{"delta":{"content":["a"]},"finish_reason":"stop"}]}'],
    "choices not a list": [
        b'{"choices":{"index":0},"usage":null}',
        b'{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}',
    ],
    "choices false": [b'{"choices":false}', b'{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}'],
    "choice not an object": [b'{"choices":["a"]}'],
    "finish reason a number": [b'{"choices":[{"delta":{"content":"a"},"finish_reason":1}]}'],
    "reasoning": [b'{"choices":[{"delta":{"reasoning":"hm","content":"a"},"finish_reason":"stop"}]}'],
    "empty reasoning": [b'{"choices":[{"delta":{"reasoning_content":"","content":"a"},"finish_reason":"stop"}]}'],
    "tool calls not a list": [b'{"choices":[{"delta":{"content":"a","tool_calls":5},"finish_reason":"stop"}]}'],
    "tool call pieces": [
        b'{"choices":[{"delta":{"tool_calls":[{"index":0,"id":"c1","function":{"name":"f","arguments":"{"}},"x"]}}]}',
        b'{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"}"}}]},"finish_reason":"tool_calls"}]}',
    ],
    "not json": [b'{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}', b"{not json"],
    "empty data": [b'{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}', b""],
    "two objects in one event": [b'{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]},{"choices":[]}'],
    "an array": [b'[{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}]'],
    "a lone surrogate": [b'{"choices":[{"delta":{"content":"\\ud800"},"finish_reason":"stop"}]}'],
    "done with a space": [b'{"choices":[{"delta":{"content":"a"},"finish_reason":"stop"}]}', b"[DONE] "],
}


@pytest.mark.parametrize("values", ODD_EVENTS.values(), ids=ODD_EVENTS.keys())
def test_events_of_one_data_line_read_as_chunks_give_what_the_framed_read_gives(values: list[bytes]) -> None:
    """vLLM's events (one ``data:`` line each) are read as chat chunks, the rest framed and
    parsed as dicts: on any data, the two give the same answer and counts."""
    body = b"".join(b"data: " + value + b"\n\n" for value in [*values, b"[DONE]"])
    chunked, framed = collect(body), collect(body.replace(b"\n", b"\r\n"))
    for collector in (chunked, framed):
        collector.answer()
    assert chunked.answer() == framed.answer()
    assert (chunked.prompt_tokens, chunked.cached_tokens, chunked.completion_tokens) == (
        framed.prompt_tokens,
        framed.cached_tokens,
        framed.completion_tokens,
    )


def test_events_of_one_data_line_are_not_parsed_into_dicts(monkeypatch: pytest.MonkeyPatch) -> None:
    import pdclient.conversations._answer as answer_module

    def no_dicts(raw: bytes) -> object:
        raise AssertionError(f"parsed into dicts: {raw!r}")

    monkeypatch.setattr(answer_module, "event_json", no_dicts)
    usage = {"id": "c", "choices": [], "usage": {"prompt_tokens": 40, "completion_tokens": 2}}
    assert collect(sse(chunk({"content": "a"}), chunk({"content": "b"}, "stop"), usage)).answer() == Answer(
        "ab", (), 2, False
    )


def test_a_json_answer_is_read_at_its_end() -> None:
    import json

    body = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1},
    }
    collector = collect(json.dumps(body).encode(), stream=False)
    assert collector.answer() == Answer("Hi", (), 1, False)
    assert collector.prompt_tokens == 5
    assert collect(b'{"choices": [', stream=False).answer() is None


# -- read from the call alone (another replica's turns) ---------------------------------


def test_a_call_no_one_here_saw_is_read_from_its_own_messages() -> None:
    mem = ConversationMemory()
    system = {"role": "system", "content": "x" * 2000}
    turn = [
        system,
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "r"},
    ]
    estimate = mem.estimate("k", {"messages": turn}, ADMITTED, home=D2)
    assert (estimate.match, estimate.endpoint) == (Match.EXTENDS_HISTORY, D2)
    assert estimate.cached_tokens > 0 and estimate.uncached_tokens < 256
    # Without a home (no rendezvous, or passed over for its load) nothing is cached.
    assert mem.estimate("k", {"messages": turn}, ADMITTED).match is Match.UNKNOWN
    # A first turn has nothing before it.
    assert mem.estimate("k", {"messages": turn[:2]}, ADMITTED, home=D2).match is Match.UNKNOWN


def test_turns_answered_elsewhere_since_the_remembered_one_are_read_from_the_call() -> None:
    mem = ConversationMemory()
    system = {"role": "system", "content": "x" * 2000}
    first = [system, {"role": "user", "content": "q"}]
    mem.remember("k", {"messages": first}, Answer("a", completion_tokens=2), D2, prompt_tokens=1010)
    later = [*first, {"role": "assistant", "content": "a"}, {"role": "user", "content": "r"}]
    later += [{"role": "assistant", "content": "b"}, {"role": "user", "content": "s"}]
    estimate = mem.estimate("k", {"messages": later}, ADMITTED, home=D2)
    assert (estimate.match, estimate.endpoint) == (Match.EXTENDS_HISTORY, D2)


def conversation_read_from_the_call(answer: dict[str, Any], question: str = "q" * 40) -> dict[str, Any]:
    """A system message and question whose prompt is 1,000 tokens at 4 chars per token
    (8 per message and the generation prompt's 8 included), an answer, a new question."""
    system = {"role": "system", "content": "x" * (4 * (1000 - 3 * 8) - len("system") - len("user") - 1)}
    return body(system, {"role": "user", "content": "q"}, answer, {"role": "user", "content": question})


def warm_memory(chars_per_token: float = 4.0) -> ConversationMemory:
    mem = memory(ratio_warmup=1)
    mem.learn(sample(round(1000 * chars_per_token)), 1000)
    return mem


def test_an_answer_read_from_the_call_is_cached_up_to_its_last_whole_block() -> None:
    mem = warm_memory()
    call = conversation_read_from_the_call({"role": "assistant", "content": "a" * 1200})  # 300 tokens
    estimate = mem.estimate("k", call, ADMITTED, home=D2)
    assert (estimate.match, estimate.endpoint) == (Match.EXTENDS_HISTORY, D2)
    # The endpoint computed the 1,000-token prompt and the answer: 1,300 ids, ten whole blocks.
    assert estimate.cached_tokens == 1280
    assert estimate.uncached_tokens == estimate.total_tokens - 1280 < 128


@pytest.mark.parametrize(
    "answer",
    [
        {"role": "assistant", "content": None, "tool_calls": [WEATHER_CALL]},
        {"role": "assistant", "content": "a" * 1200, "reasoning_content": "hm"},
        {"role": "assistant", "content": [{"type": "text", "text": "a" * 600}, {"type": "text", "text": "b"}]},
    ],
)
def test_an_answer_the_template_renders_its_own_way_is_not_counted_as_cached(answer: dict[str, Any]) -> None:
    estimate = warm_memory().estimate("k", conversation_read_from_the_call(answer), ADMITTED, home=D2)
    assert estimate.cached_tokens == 896  # the prompt's seven whole blocks


@pytest.mark.parametrize("answer_tokens", [1, 10, 24, 25, 32, 100, 127])
def test_an_answer_shorter_than_a_block_moves_the_cached_count_by_one_block_at_most(answer_tokens: int) -> None:
    """After a P/D turn vLLM 0.32's decode server may miss the block that holds the prompt's
    tail and the answer's start; the call does not say which way the turn went, so the
    estimate is then short by that block, never more."""
    answer = {"role": "assistant", "content": "a" * (4 * answer_tokens)}
    estimate = warm_memory().estimate("k", conversation_read_from_the_call(answer), ADMITTED, home=D2)
    prompt_blocks = 896  # floor(1000 / 128) whole blocks
    # The answer's text ids (its end-of-turn id, never computed, not among them) end at 1000 + n.
    assert estimate.cached_tokens - prompt_blocks == (128 if 1000 + answer_tokens >= 1024 else 0)


def test_a_short_follow_up_through_a_replica_that_saw_one_turn_goes_decode_only() -> None:
    """As on the real pair: the benchmark's words read ~6.5 chars per token, a ~900-token
    prompt, a 32-token answer, a 34-token question, through a replica that learned from one
    call only (another replica answered the turn before)."""
    mem = memory()  # ratio_warmup=8: one count is not warm, the margin applies
    mem.learn(sample(6500), 1000)
    system = {"role": "system", "content": "river stone " * 480}
    answer = {"role": "assistant", "content": "lantern orbit " * 15}
    question = {"role": "user", "content": "And this: " + "velvet harbor " * 15}
    call = body(system, {"role": "user", "content": "Summarize."}, answer, question)
    estimate = mem.estimate(key_of(call), call, ADMITTED, home=D1)
    decision = decide_remote_prefill("auto", estimate, mem.settings)
    assert estimate.match is Match.EXTENDS_HISTORY
    assert (decision.remote_prefill, decision.reason) == (False, Reason.DECODE_ONLY_FASTER), estimate
    # The answer's and the question's ~66 ids stay counted, with the partial last block.
    assert 66 <= estimate.uncached_tokens < 66 + 128 + 40, estimate


def test_a_made_up_history_with_a_long_document_is_not_taken_as_cached() -> None:
    """A first call whose history no one here answered: a long document, a short assistant
    message no server wrote, a question. Only ``unseen_history_tokens`` of it count as
    cached on the call's word, so it goes through the prefill."""
    mem = warm_memory()  # 4 chars per token
    document = {"role": "user", "content": "word " * 80_000}  # 100,000 tokens
    call = body(document, {"role": "assistant", "content": "Noted."}, {"role": "user", "content": "And its title?"})
    estimate = mem.estimate(key_of(call), call, ADMITTED, home=D1)
    decision = decide_remote_prefill("auto", estimate, mem.settings)
    assert (estimate.match, estimate.endpoint) == (Match.UNSEEN_HISTORY, D1)
    assert estimate.cached_tokens <= mem.settings.unseen_history_tokens
    assert estimate.uncached_tokens >= 100_000 - mem.settings.unseen_history_tokens
    assert (decision.remote_prefill, decision.reason) == (True, Reason.UNCACHED_RATIO_AT_OR_ABOVE)
    # With 0, nothing this process did not see answered counts as cached at all.
    strict = memory(ratio_warmup=1, unseen_history_tokens=0)
    strict.learn(sample(4000), 1000)
    short = conversation_read_from_the_call({"role": "assistant", "content": "a" * 1200})
    assert strict.estimate("k", short, ADMITTED, home=D2).cached_tokens == 0


def test_made_up_turns_after_a_remembered_one_count_only_what_was_remembered() -> None:
    mem = warm_memory()
    first = [{"role": "system", "content": "x" * 3890}, {"role": "user", "content": "q"}]
    mem.remember("k", body(*first), Answer("a" * 40, completion_tokens=11), D2, prompt_tokens=1019)
    later = [*first, {"role": "assistant", "content": "a" * 40}, {"role": "user", "content": "word " * 80_000}]
    later += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": "And its title?"}]
    estimate = mem.estimate("k", body(*later), ADMITTED, home=D2)
    assert estimate.match is Match.UNSEEN_HISTORY
    assert estimate.cached_tokens <= 1019 + mem.settings.unseen_history_tokens
    assert decide_remote_prefill("auto", estimate, mem.settings).remote_prefill


def test_a_remembered_prompt_anchors_the_turns_answered_elsewhere_since() -> None:
    """A replica that answered turn 1 and sees turn 3 knows turn 1's prompt length from its
    server: only turn 2's answer and question and turn 3's are estimated from their text."""
    mem = warm_memory()  # 4 chars per token learned
    first = [{"role": "system", "content": "x" * 3890}, {"role": "user", "content": "q"}]
    mem.remember("k", body(*first), Answer("a" * 40, completion_tokens=11), D2, prompt_tokens=1019)
    own_ratio = rendered_chars(first) / 1019
    later = [*first, {"role": "assistant", "content": "a" * 40}, {"role": "user", "content": "r" * 80}]
    later += [{"role": "assistant", "content": "b" * 40}, {"role": "user", "content": "s" * 80}]
    estimate = mem.estimate("k", body(*later), ADMITTED, home=D2)
    assert (estimate.match, estimate.endpoint) == (Match.EXTENDS_HISTORY, D2)
    rest = mem.tokens_for(rendered_chars(later[2:]), len(later) - 2, own_ratio)
    assert estimate.total_tokens == 1019 + rest
    reused = 1019 + mem.tokens_for(rendered_chars(later[2:4]), 2, own_ratio) + mem.tokens_for(40, 0, own_ratio)
    assert estimate.cached_tokens == reused // 128 * 128 >= 1024
    # A replica that saw none of it reads 1019 ids' worth of text as fewer (4 chars per token).
    unseen = warm_memory().estimate("k", body(*later), ADMITTED, home=D2)
    assert unseen.total_tokens < estimate.total_tokens


# -- the servers' own KV events ---------------------------------------------------------

KEYS_1328 = pack(list(range(1, 1328 // 128 + 1)))  # the first turn's prompt: 10 whole blocks


def held_by(tokens: int | None, asked: list[tuple[str, int]] | None = None) -> Any:
    def held(endpoint: str, keys: Any, block_size: int) -> int | None:
        if asked is not None:
            asked.append((endpoint, len(keys)))
        return tokens

    return held


def keyed_first_turn(mem: ConversationMemory) -> dict[str, Any]:
    turn1 = body(SYSTEM, USER)
    answer = Answer(STORY, completion_tokens=150)
    mem.remember(key_of(turn1), turn1, answer, D1, prompt_tokens=1328, prompt_keys=KEYS_1328)
    return body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP)


def test_a_follow_up_whose_prefix_the_events_say_is_gone_is_wholly_uncached() -> None:
    mem = memory()
    turn2 = keyed_first_turn(mem)
    asked: list[tuple[str, int]] = []
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED, held=held_by(0, asked))
    assert (D1, 10) in asked
    assert estimate.cache_source == "kv_events"
    assert estimate.cached_tokens == 0 and estimate.endpoint == D1
    assert decide_remote_prefill("auto", estimate, ConversationSettings()).remote_prefill


def test_events_that_hold_part_of_the_prefix_count_that_part() -> None:
    mem = memory()
    turn2 = keyed_first_turn(mem)
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED, held=held_by(384))
    assert (estimate.cache_source, estimate.cached_tokens) == ("kv_events", 384)


def test_events_that_hold_the_whole_prefix_confirm_the_estimate() -> None:
    mem = memory()
    turn2 = keyed_first_turn(mem)
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED, held=held_by(1280))
    assert (estimate.cache_source, estimate.cached_tokens) == ("kv_events", 1408)  # the answer's blocks too


def test_without_an_answer_from_the_events_the_estimator_decides() -> None:
    mem = memory()
    turn2 = keyed_first_turn(mem)
    for held in (held_by(None), None):
        estimate = mem.estimate(key_of(turn2), turn2, ADMITTED, held=held)
        assert (estimate.cache_source, estimate.cached_tokens) == ("estimate", 1408)


def test_prompt_keys_cost_eight_bytes_a_block() -> None:
    mem = memory()
    keyed_first_turn(mem)
    (entry,) = mem._turns.values()
    plain = memory()
    first_turn(plain)
    (bare,) = plain._turns.values()
    assert len(entry.packed) - len(bare.packed) == 8 * 10


def test_a_decode_only_turn_keeps_the_known_prefix_of_the_turn_it_extends() -> None:
    mem = memory()
    turn2 = keyed_first_turn(mem)
    mem.remember(key_of(turn2), turn2, Answer("A title.", completion_tokens=4), D1, prompt_tokens=1500)
    turn3 = body(*turn2["messages"], {"role": "assistant", "content": "A title."}, USER)
    estimate = mem.estimate(key_of(turn3), turn3, ADMITTED, held=held_by(0))
    assert (estimate.cache_source, estimate.cached_tokens) == ("kv_events", 0)
    # An edited conversation starts afresh: the old prefix is not its own.
    edited = body(SYSTEM, FOLLOW_UP)
    mem.remember(key_of(turn2), edited, Answer("x", completion_tokens=1), D1, prompt_tokens=900)
    assert mem._turns[next(iter(mem._turns))].turn().prompt_keys == b""


def held_at(tokens: dict[str, int | None]) -> Any:
    return lambda endpoint, keys, block_size: tokens.get(endpoint)


def test_a_follow_up_goes_where_the_events_say_most_of_its_prefix_is() -> None:
    mem = memory()
    turn2 = keyed_first_turn(mem)
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED, held=held_at({D1: 0, D2: 1280}))
    # Only the known prefix counts there: the answer was computed on D1.
    assert (estimate.endpoint, estimate.cached_tokens, estimate.cache_source) == (D2, 1280, "kv_events")


def test_a_follow_up_whose_endpoint_left_goes_where_its_prefix_is() -> None:
    mem = memory()
    turn2 = keyed_first_turn(mem)
    estimate = mem.estimate(key_of(turn2), turn2, {D2}, held=held_at({D2: 640}))
    assert (estimate.endpoint, estimate.cached_tokens, estimate.match) == (D2, 640, Match.EXTENDS_ANSWER)


def test_ties_stay_with_the_endpoint_that_answered_then_the_home() -> None:
    mem = memory()
    turn2 = keyed_first_turn(mem)
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED, held=held_at({D1: 1280, D2: 1280}))
    assert (estimate.endpoint, estimate.cached_tokens) == (D1, 1408)
    d3 = "http://decode-3:8200/v1"
    estimate = mem.estimate(key_of(turn2), turn2, {D2, d3}, D2, held=held_at({D2: 640, d3: 640}))
    assert estimate.endpoint == D2


KEYS_1477 = pack(list(range(1, 1477 // 128 + 1)))
"""The first turn's prompt (1328 ids) and its answer but the last id (150 - 1): 11 whole blocks."""


def answer_keyed_first_turn(mem: ConversationMemory, *, prompt_pulled: bool) -> dict[str, Any]:
    turn1 = body(SYSTEM, USER)
    answer = Answer(STORY, completion_tokens=150)
    mem.remember(
        key_of(turn1),
        turn1,
        answer,
        D1,
        prompt_tokens=1328,
        prompt_pulled=prompt_pulled,
        prompt_keys=KEYS_1477,
        answer_keyed=True,
    )
    return body(SYSTEM, USER, {"role": "assistant", "content": STORY}, FOLLOW_UP)


def test_keys_of_the_answer_make_its_blocks_exact_after_a_handoff() -> None:
    """After a P/D turn the estimator counts only the pulled prompt's blocks; the decode's
    events about the answer's own ids say what it holds of the answer too."""
    mem = memory()
    turn2 = answer_keyed_first_turn(mem, prompt_pulled=True)
    alone = mem.estimate(key_of(turn2), turn2, ADMITTED)
    assert (alone.cache_source, alone.cached_tokens) == ("estimate", 1280)
    asked: list[tuple[str, int]] = []
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED, held=held_by(1408, asked))
    assert (D1, 11) in asked
    assert (estimate.cache_source, estimate.cached_tokens) == ("kv_events", 1408)


def test_keys_of_the_answer_count_only_what_the_decode_holds_of_them() -> None:
    mem = memory()
    turn2 = answer_keyed_first_turn(mem, prompt_pulled=False)
    estimate = mem.estimate(key_of(turn2), turn2, ADMITTED, held=held_by(1280))
    assert (estimate.cache_source, estimate.cached_tokens) == ("kv_events", 1280)


def test_a_follow_up_without_the_answer_counts_none_of_its_blocks() -> None:
    mem = memory()
    answer_keyed_first_turn(mem, prompt_pulled=False)
    other = body(SYSTEM, USER, FOLLOW_UP)  # the answer left out: only the prompt's blocks are its prefix
    estimate = mem.estimate(key_of(other), other, ADMITTED, held=held_by(1408))
    assert (estimate.cache_source, estimate.cached_tokens) == ("kv_events", 1280)


def test_a_decode_only_turn_without_ids_does_not_claim_its_answer_keyed() -> None:
    mem = memory()
    turn2 = answer_keyed_first_turn(mem, prompt_pulled=False)
    mem.remember(key_of(turn2), turn2, Answer("A title.", completion_tokens=4), D1, prompt_tokens=1500)
    (entry,) = mem._turns.values()
    assert (entry.turn().prompt_keys, entry.turn().answer_keyed) == (KEYS_1477, False)


# -- a history no one here saw, read against the decode's KV events ----------------------


def few_shot() -> dict[str, Any]:
    return body(
        {"role": "system", "content": "x" * 2000},
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "r"},
    )


def test_an_unseen_history_asks_for_its_ids_only_when_the_endpoints_events_are_current() -> None:
    mem = ConversationMemory()
    call = few_shot()
    estimate = mem.estimate("k", call, ADMITTED, home=D2)
    assert estimate.match is Match.EXTENDS_HISTORY
    live = lambda endpoint, keys, block: 0  # noqa: E731
    unknown = lambda endpoint, keys, block: None  # noqa: E731
    assert mem.wants_prompt_ids(estimate, live)
    assert not mem.wants_prompt_ids(estimate, unknown)  # no view to ask: the estimate decides
    assert not mem.wants_prompt_ids(estimate, None)
    # A first turn, a remembered conversation, or a history too short to hold a block: no.
    assert not mem.wants_prompt_ids(mem.estimate("k", body(*call["messages"][:2]), ADMITTED, home=D2), live)
    short = body(*few_shot()["messages"][1:])
    assert not mem.wants_prompt_ids(mem.estimate("k", short, ADMITTED, home=D2), live)


def test_an_unseen_history_is_cached_as_far_as_the_decodes_events_hold_its_ids() -> None:
    """The prompt's own ids (the prefill server's /tokenize): the count is exact, the
    decode's index says how much of it the decode holds."""
    mem = ConversationMemory()
    estimate = mem.estimate("k", few_shot(), ADMITTED, home=D2)
    ids = list(range(1000))
    keys = chain_keys(ids, 128)
    asked: list[tuple[str, int]] = []

    def holds(blocks: int) -> Any:
        def held(endpoint: str, chain: Any, block: int) -> int:
            asked.append((endpoint, block))
            held_blocks = 0
            for key in chain:
                if key not in keys[:blocks]:
                    break
                held_blocks += 1
            return held_blocks * block

        return held

    nothing = mem.with_prompt_ids(estimate, ids, holds(0))
    assert (nothing.total_tokens, nothing.cached_tokens, nothing.cache_source) == (1000, 0, "kv_events")
    assert decide_remote_prefill("auto", nothing, mem.settings).remote_prefill
    assert asked == [(D2, 128)]
    most = mem.with_prompt_ids(estimate, ids, holds(7))
    assert (most.total_tokens, most.cached_tokens, most.endpoint, most.match) == (1000, 896, D2, estimate.match)
    # The view went unknown meanwhile: the estimate stands.
    assert mem.with_prompt_ids(estimate, ids, lambda endpoint, keys, block: None) == estimate
