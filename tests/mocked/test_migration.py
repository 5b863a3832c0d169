"""Decode migration (issue 15) on the mocked pair: exact continuation bodies, the splice, every refusal.

The fake decode (tests/fake_vllm.py) streams token ids when asked and continues an answer
from the ids a prompt ends with; ``FakeVLLM.cuts`` breaks the next streamed decodes after
a number of SSE frames, as a server that dies mid-answer.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from pdclient import CallView, LegView, PDConfigError, PDObserver, PDOptions, PDTrace
from pdclient.migration import _continuation as migrate
from tests.fake_vllm import ANSWER_ID, DECODE, DECODE2, EOS_ID, PREFILL, FakeVLLM, VLLMAnswers, ids_of_last_message
from tests.twins import Twin

DECODE3 = "http://decode3.test:8200/v1"
WORDS = ["The", " answer", " comes", " in", " seven", " small", " pieces"]
ANSWER = "".join(WORDS)
MESSAGES: Any = [{"role": "user", "content": "Tell me."}]
PROMPT_IDS = ids_of_last_message({"messages": MESSAGES})


def answers(words: list[str] = WORDS) -> VLLMAnswers:
    return VLLMAnswers(text=lambda body: "".join(words), pieces=lambda text: list(words))


@pytest.fixture
def pool() -> Iterator[FakeVLLM]:
    """A prefill and three decode endpoints answering as vLLM 0.32 does."""
    vllm = FakeVLLM(answers())
    with vllm.routes(PREFILL, DECODE, DECODE2, DECODE3):
        yield vllm


class Legs(PDObserver):
    def __init__(self) -> None:
        self.events: list[str] = []
        self.traces: list[PDTrace] = []

    def on_leg_start(self, call: CallView, leg: LegView) -> None:
        self.events.append(f"{leg.name} {leg.attempt} {leg.url.split('//')[1].split('.')[0]}")

    def on_leg_end(self, call: CallView, leg: LegView, status: int | None, error: BaseException | None) -> None:
        self.events.append(f"{leg.name} {leg.attempt} {status} {type(error).__name__ if error else ''}".rstrip())

    def on_call_end(self, call: CallView, trace: PDTrace) -> None:
        self.traces.append(trace)


def twin(mode: str, decode: list[str] | None = None, **kwargs: Any) -> tuple[Twin, Legs]:
    legs = Legs()
    return Twin(
        mode, decode_base_url=decode or [DECODE, DECODE2], routing="round_robin", observers=[legs], **kwargs
    ), legs


async def chunks(t: Twin, **kwargs: Any) -> list[Any]:
    if "prompt" not in kwargs:
        kwargs.setdefault("messages", MESSAGES)
    kwargs.setdefault("model", "m")
    create = t.client.completions.create if "prompt" in kwargs else t.client.chat.completions.create
    stream = await t.call(create, stream=True, **kwargs)
    return list(stream) if t.mode == "sync" else [c async for c in stream]


def text_of(received: list[Any]) -> str:
    return "".join(c.choices[0].delta.content or "" for c in received if c.choices)


def caller_saw_no_ids(received: list[Any]) -> bool:
    for chunk in received:
        extra = chunk.model_extra or {}
        choice_extra = (chunk.choices[0].model_extra or {}) if chunk.choices else {}
        if "prompt_token_ids" in extra or "token_ids" in choice_extra or "prompt_token_ids" in choice_extra:
            return False
    return True


# -- the continuation ------------------------------------------------------------------------


async def test_only_a_stream_that_stayed_on_its_decode_teaches_the_cost_model(mode: str, pool: FakeVLLM) -> None:
    """The time to first token of a moved stream says nothing of the decode it ended on."""
    t, legs = twin(mode)
    costs = t.client.pd_fleet.costs
    pool.cuts = [3]
    assert text_of(await chunks(t, max_tokens=20)) == ANSWER
    assert legs.traces[-1].migrations and costs.handover().samples == 0
    assert text_of(await chunks(t, max_tokens=20)) == ANSWER
    assert not legs.traces[-1].migrations and costs.handover().samples == 1
    await t.close()


@pytest.mark.parametrize("frames", [1, 2, 4, 8])
async def test_a_cut_stream_continues_on_another_decode(mode: str, pool: FakeVLLM, frames: int) -> None:
    """Cut after the role chunk only (frames=1), mid-answer, and after the last word (before the finish)."""
    pool.cuts = [frames]
    t, legs = twin(mode)
    received = await chunks(t, max_tokens=20, stream_options={"include_usage": True})
    kept = frames - 1  # the role chunk carries no token
    assert text_of(received) == ANSWER
    assert caller_saw_no_ids(received)
    first, continuation = pool.decode_bodies
    assert first["return_token_ids"] is True and pool.decode_urls[0] == DECODE
    assert pool.decode_urls[1] == DECODE2
    assert continuation["kv_transfer_params"] == {"prompt_token_ids": PROMPT_IDS + [ANSWER_ID + i for i in range(kept)]}
    assert continuation["max_tokens"] == 20 - kept
    assert continuation["messages"] == MESSAGES and continuation["stream"] is True
    assert {c.id for c in received} == {"chatcmpl-d"} and {c.model for c in received} == {"m"}
    roles = [c.choices[0].delta.role for c in received if c.choices and c.choices[0].delta.role]
    assert roles == ["assistant"], "one role chunk, the first server's"
    usage = received[-1].usage
    assert usage is not None and usage.prompt_tokens == len(PROMPT_IDS)
    assert usage.completion_tokens == len(WORDS) and usage.total_tokens == len(PROMPT_IDS) + len(WORDS)
    (trace,) = legs.traces
    assert trace.outcome.value == "disaggregated" and trace.error is None
    (moved,) = trace.migrations
    assert (moved.from_url, moved.to_url, moved.after_tokens, moved.route) == (DECODE, DECODE2, kept, "decode")
    assert moved.pause_ms is not None and moved.pause_ms >= 0 and "RemoteProtocolError" in moved.cause
    assert trace.fallback is not None and "decode stream moved" in trace.fallback
    assert legs.events == [
        "prefill 1 prefill",
        "prefill 1 200",
        "decode 1 decode",
        "decode 1 200 RemoteProtocolError",
        "decode 2 decode2",
        "decode 2 200",
    ]
    await t.close()


async def test_completions_continue_with_an_id_prompt(mode: str, pool: FakeVLLM) -> None:
    pool.cuts = [3]
    t, legs = twin(mode)
    received = await chunks(t, prompt="Once upon a time", max_tokens=10)
    assert "".join(c.choices[0].text for c in received) == ANSWER
    continuation = pool.decode_bodies[1]
    kept = [ANSWER_ID, ANSWER_ID + 1, ANSWER_ID + 2]  # no role chunk on completions: 3 frames, 3 tokens
    assert continuation["prompt"] == ids_of_last_message({"prompt": "Once upon a time"}) + kept
    assert continuation["max_tokens"] == 7 and "kv_transfer_params" not in continuation
    assert legs.traces[0].migrations[0].after_tokens == 3
    assert caller_saw_no_ids(received)
    await t.close()


async def test_a_token_without_text_is_held_until_text_follows(mode: str) -> None:
    """A chunk with ids and no text (a character split across tokens) is held back, so a cut
    right after it continues before that token: the caller's text and the ids stay aligned."""
    words = ["A", "", "é", " and", " more"]
    vllm = FakeVLLM(answers(words))
    with vllm.routes(PREFILL, DECODE, DECODE2):
        vllm.cuts = [3]  # role, "A", "" (held) | cut
        t, legs = twin(mode)
        received = await chunks(t)
        assert text_of(received) == "Aé and more"
        assert vllm.decode_bodies[1]["kv_transfer_params"]["prompt_token_ids"][-1] == ANSWER_ID, "only 'A' was kept"
        assert legs.traces[0].migrations[0].after_tokens == 1
        await t.close()


async def test_the_callers_own_token_ids_pass_through(mode: str, pool: FakeVLLM) -> None:
    pool.cuts = [3]
    t, _ = twin(mode)
    received = await chunks(t, extra_body={"return_token_ids": True})
    ids = [i for c in received if c.choices for i in (c.choices[0].model_extra or {}).get("token_ids") or []]
    assert ids == [ANSWER_ID + i for i in range(len(WORDS))] + [EOS_ID]
    prompt_ids = [c.model_extra["prompt_token_ids"] for c in received if "prompt_token_ids" in (c.model_extra or {})]
    assert prompt_ids == [PROMPT_IDS], "the caller's prompt ids once, never the continuation's"
    await t.close()


async def test_migrations_are_bounded_by_the_setting(mode: str, pool: FakeVLLM) -> None:
    pool.cuts = [2, 3]
    t, legs = twin(mode, decode=[DECODE, DECODE2, DECODE3], max_decode_migrations=2)
    received = await chunks(t)
    assert text_of(received) == ANSWER
    assert sorted(pool.decode_urls) == [DECODE, DECODE2, DECODE3], "each continuation on an endpoint not yet broken"
    second = pool.decode_bodies[2]["kv_transfer_params"]["prompt_token_ids"]
    assert second == PROMPT_IDS + [ANSWER_ID + i for i in range(3)], "1 kept on the first, 2 more on the second"
    assert [m.after_tokens for m in legs.traces[0].migrations] == [1, 3]
    await t.close()

    pool.cuts = [2, 3]
    t, legs = twin(mode, decode=[DECODE, DECODE2, DECODE3])  # the default: 1
    with pytest.raises(openai.APIConnectionError, match=r"max_decode_migrations \(1\) reached"):
        await chunks(t)
    assert len(legs.traces[0].migrations) == 1 and "max_decode_migrations (1) reached" in (legs.traces[0].error or "")
    await t.close()


async def test_a_long_prompt_continues_through_a_prefill(
    mode: str, pool: FakeVLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate, "REMOTE_PREFILL_MIN_TOKENS", 1)
    pool.cuts = [3]
    t, legs = twin(mode)
    received = await chunks(t, max_tokens=30)
    assert text_of(received) == ANSWER
    ids = [*PROMPT_IDS, ANSWER_ID, ANSWER_ID + 1]
    _, continuation_prefill = pool.prefill_bodies
    kv = continuation_prefill["kv_transfer_params"]
    assert kv["do_remote_decode"] is True and kv["prompt_token_ids"] == ids
    assert continuation_prefill["max_tokens"] == 1 and continuation_prefill["stream"] is False
    decode = pool.decode_bodies[1]
    assert decode["kv_transfer_params"]["remote_engine_id"] == "engine-p"
    assert decode["kv_transfer_params"]["prompt_token_ids"] == ids and decode["max_tokens"] == 28
    assert legs.traces[0].migrations[0].route == "prefill+decode"
    assert legs.events[-4:] == ["prefill 2 prefill", "prefill 2 200", "decode 2 decode2", "decode 2 200"]
    await t.close()


async def test_a_failed_continuation_prefill_falls_back_to_the_decode(
    mode: str, pool: FakeVLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(migrate, "REMOTE_PREFILL_MIN_TOKENS", 1)
    pool.cuts = [3]
    calls = {"n": 0}

    def prefill(request: httpx.Request) -> httpx.Response:
        calls["n"] += 1
        return pool.respond(request) if calls["n"] == 1 else httpx.Response(503, json={"error": "busy"})

    pool.router.routes["prefill"].mock(side_effect=prefill)
    t, legs = twin(mode)
    assert text_of(await chunks(t)) == ANSWER
    assert pool.decode_bodies[1]["kv_transfer_params"] == {"prompt_token_ids": [*PROMPT_IDS, ANSWER_ID, ANSWER_ID + 1]}
    moved = legs.traces[0].migrations[0]
    assert moved.route == "decode" and "HTTP 503" in moved.cause
    await t.close()


async def test_no_token_ids_are_asked_for_when_the_call_cannot_move(mode: str, pool: FakeVLLM) -> None:
    for decode, options in (([DECODE, DECODE2], {"max_decode_migrations": 0}), ([DECODE], {})):
        pool.decode_bodies.clear()
        t, _ = twin(mode, decode=decode, **options)
        assert text_of(await chunks(t)) == ANSWER
        assert "return_token_ids" not in pool.decode_bodies[0]
        await t.close()


# -- refusals: raised as before, with the reason ---------------------------------------------------

REFUSALS: list[tuple[dict[str, Any], str]] = [
    ({"n": 2}, "n > 1"),
    ({"stop": ["\n\n"]}, "stop strings"),
    ({"stop": "END"}, "stop strings"),
    ({"response_format": {"type": "json_object"}}, "structured output"),
    ({"extra_body": {"structured_outputs": {"regex": "a+"}}}, "structured output"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 0.1}, "frequency_penalty"),
    ({"seed": 7, "temperature": 0.8}, "a seeded sample"),
    ({"extra_body": {"bad_words": ["x y"]}}, "bad_words"),
    ({"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),
    ({"extra_body": {"echo": True}}, "ids are not forwarded (echo)"),
    ({"extra_body": {"pdclient": {"forward_ids": False}}}, "ids are not forwarded (forward_ids off)"),
    ({"extra_body": {"pdclient": {"max_decode_migrations": 0}}}, "max_decode_migrations is 0"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
        "ids are not forwarded (media)",
    ),
]


@pytest.mark.parametrize(("request_fields", "reason"), REFUSALS, ids=[r for _, r in REFUSALS])
async def test_refused_where_a_continuation_would_not_be_exact(
    mode: str, pool: FakeVLLM, request_fields: dict[str, Any], reason: str
) -> None:
    pool.cuts = [3]
    t, legs = twin(mode)
    with pytest.raises(openai.APIConnectionError, match=f"decode stream broke.*not migrated: .*{re.escape(reason)}"):
        await chunks(t, **request_fields)
    assert len(pool.decode_bodies) == 1 and "return_token_ids" not in pool.decode_bodies[0]
    (trace,) = legs.traces
    assert trace.outcome.value == "failed" and "not migrated: " in (trace.error or "") and reason in trace.error
    assert trace.migrations == ()
    await t.close()


async def test_refused_with_tools_offered(mode: str, pool: FakeVLLM) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    pool.cuts = [1]
    t, _ = twin(mode)
    with pytest.raises(openai.APIConnectionError, match="not migrated: tools offered"):
        await chunks(t, tools=[tool])
    await t.close()


async def test_refused_with_one_decode_endpoint(mode: str, pool: FakeVLLM) -> None:
    pool.cuts = [3]
    t, _ = twin(mode, decode=[DECODE])
    with pytest.raises(openai.APIConnectionError, match="not migrated: no other decode endpoint"):
        await chunks(t)
    await t.close()


def reasoning_then_cut(request: httpx.Request) -> httpx.Response:
    """A decode whose answer starts with reasoning (a reasoning parser on the server), then dies."""
    from tests.fake_vllm import CutStream

    def frame(delta: dict[str, Any], ids: list[int]) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, "token_ids": ids}
        event = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 1, "model": "m", "choices": [choice]}
        return b"data: " + json.dumps(event).encode() + b"\n\n"

    frames = [frame({"role": "assistant", "content": ""}, []), frame({"reasoning": "Hmm"}, [7])]
    return httpx.Response(200, stream=CutStream(frames), headers={"content-type": "text/event-stream"})


async def test_refused_once_reasoning_started(mode: str, pool: FakeVLLM) -> None:
    pool.router.routes["decode"].mock(side_effect=reasoning_then_cut)
    t, legs = twin(mode)
    with pytest.raises(openai.APIConnectionError, match="not migrated: reasoning had started"):
        await chunks(t)
    assert len(legs.traces[0].migrations) == 0
    await t.close()


async def test_refused_when_the_continuation_fails(mode: str, pool: FakeVLLM) -> None:
    pool.cuts = [3]
    pool.router.routes["decode2"].mock(return_value=httpx.Response(500, json={"error": "down"}))
    t, legs = twin(mode)
    with pytest.raises(openai.APIConnectionError, match=r"not migrated: the continuation failed: .*HTTP 500"):
        await chunks(t)
    assert legs.events[-2:] == ["decode 2 decode2", "decode 2 500"]
    await t.close()


# -- a stream cut after its answer ended ----------------------------------------------------------

FINISHED = 1 + len(WORDS) + 1  # the role chunk, one chunk per word, the finish chunk


async def test_a_stream_cut_after_its_finish_chunk_ends_as_the_server_ended_it(mode: str, pool: FakeVLLM) -> None:
    pool.cuts = [FINISHED]
    t, legs = twin(mode)
    received = await chunks(t, stream_options={"include_usage": True})
    assert text_of(received) == ANSWER
    assert [c.choices[0].finish_reason for c in received if c.choices and c.choices[0].finish_reason] == ["stop"]
    usage = received[-1].usage  # made of the ids pdclient holds: the words and the end-of-sequence token
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(PROMPT_IDS), len(WORDS) + 1)
    assert {c.id for c in received} == {"chatcmpl-d"} and caller_saw_no_ids(received)
    assert len(pool.decode_bodies) == 1
    (trace,) = legs.traces
    assert trace.error is None and trace.migrations == () and trace.fallback is None
    assert legs.events[-2:] == ["decode 1 decode", "decode 1 200 RemoteProtocolError"]
    await t.close()


async def test_the_raw_stream_cut_after_its_finish_gets_usage_then_done(mode: str, pool: FakeVLLM) -> None:
    """As ``pdclient serve`` relays it: the usage event the caller asked for, then ``[DONE]``, once each."""
    pool.cuts = [FINISHED]
    t, _ = twin(mode)
    create = t.client.chat.completions.with_streaming_response.create
    body = {"model": "m", "messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}}
    if mode == "sync":
        with create(**body) as response:
            raw = b"".join(response.iter_bytes())
    else:
        async with create(**body) as response:
            raw = b"".join([part async for part in response.iter_bytes()])
    events = [e for e in raw.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and raw.count(b"[DONE]") == 1 and raw.count(b'"usage"') == 1
    usage = json.loads(events[-2][6:])
    assert usage["choices"] == [] and usage["id"] == "chatcmpl-d" and usage["object"] == "chat.completion.chunk"
    assert usage["usage"]["completion_tokens"] == len(WORDS) + 1
    await t.close()


# -- non-streamed calls ----------------------------------------------------------------------------


def cut_json_or_stream(pool: FakeVLLM) -> Any:
    """A decode that dies mid-answer whether streamed or not: a non-streamed body is cut halfway."""
    from tests.fake_vllm import CutStream

    def respond(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content).get("stream"):
            return pool.respond(request)
        whole = pool.respond(request).content
        return httpx.Response(
            200, stream=CutStream([whole[: len(whole) // 2]]), headers={"content-type": "application/json"}
        )

    return respond


@pytest.mark.parametrize("kind", ["chat", "completions"])
async def test_a_non_streamed_call_whose_decode_dies_mid_answer_moves(mode: str, pool: FakeVLLM, kind: str) -> None:
    pool.router.routes["decode"].mock(side_effect=cut_json_or_stream(pool))
    pool.router.routes["decode_completions"].mock(side_effect=cut_json_or_stream(pool))
    pool.cuts = [4]
    t, legs = twin(mode, migrate_non_streamed=True)
    if kind == "chat":
        answer = await t.chat(messages=MESSAGES, max_tokens=20)
        assert answer.choices[0].message.content == ANSWER and answer.object == "chat.completion"
    else:
        answer = await t.call(t.client.completions.create, model="m", prompt="Once upon a time", max_tokens=20)
        assert answer.choices[0].text == ANSWER and answer.object == "text_completion"
    assert answer.choices[0].finish_reason == "stop" and answer.id in ("chatcmpl-d", "cmpl-d")
    assert answer.usage.completion_tokens == len(WORDS)
    first, continuation = pool.decode_bodies
    for body in (first, continuation):
        assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
        assert body["return_token_ids"] is True
    kept = 3 if kind == "chat" else 4  # completions send no role chunk
    assert continuation["max_tokens"] == 20 - kept
    (trace,) = legs.traces
    assert trace.outcome.value == "disaggregated" and trace.error is None
    assert [m.after_tokens for m in trace.migrations] == [kept]
    await t.close()


async def test_a_non_streamed_answer_is_the_json_vllm_writes(mode: str, pool: FakeVLLM) -> None:
    t, legs = twin(mode, migrate_non_streamed=True)
    raw = await t.call(t.client.chat.completions.with_raw_response.create, model="m", messages=MESSAGES)
    body = raw.http_response.json()
    assert raw.http_response.headers["content-type"] == "application/json"
    (choice,) = body["choices"]
    assert choice["message"]["content"] == ANSWER and choice["message"]["role"] == "assistant"
    assert choice["finish_reason"] == "stop" and choice["token_ids"] is None and body["prompt_token_ids"] is None
    assert body["usage"] == {
        "prompt_tokens": len(PROMPT_IDS),
        "total_tokens": len(PROMPT_IDS) + len(WORDS),
        "completion_tokens": len(WORDS),
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    assert raw.parse().choices[0].message.content == ANSWER
    assert legs.traces[0].decode_first_byte_ms is not None
    await t.close()


@pytest.mark.parametrize(
    ("options", "request_fields", "reason"),
    [
        ({}, {}, "not streamed (migrate_non_streamed is off)"),
        ({"migrate_non_streamed": True}, {"n": 2}, "n > 1"),
        (
            {"migrate_non_streamed": True},
            {"extra_body": {"pdclient": {"max_decode_migrations": 0}}},
            "max_decode_migrations is 0",
        ),
        (
            {"migrate_non_streamed": True},
            {"stream_options": {"include_usage": True}},
            "stream_options on a non-streamed call",
        ),
    ],
    ids=["off by default", "n > 1", "max_decode_migrations 0", "stream_options"],
)
async def test_a_non_streamed_call_that_cannot_move_goes_as_before(
    mode: str, pool: FakeVLLM, options: dict[str, Any], request_fields: dict[str, Any], reason: str
) -> None:
    t, legs = twin(mode, **options)
    answer = await t.chat(messages=MESSAGES, **request_fields)
    assert answer.choices[0].message.content == ANSWER
    (body,) = pool.decode_bodies
    assert "return_token_ids" not in body and body.get("stream") is None
    assert body.get("stream_options") == request_fields.get("stream_options")

    for route in ("decode", "decode2"):
        pool.router.routes[route].mock(side_effect=cut_json_or_stream(pool))
    with pytest.raises(openai.APIConnectionError):
        await t.chat(messages=MESSAGES, **request_fields)
    assert f"not migrated: {reason}" in (legs.traces[-1].error or "")
    await t.close()


def test_migrate_non_streamed_is_a_validated_switch() -> None:
    assert PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODE).migrate_non_streamed is False
    with pytest.raises(PDConfigError, match="migrate_non_streamed must be a bool"):
        PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODE, migrate_non_streamed="yes")  # type: ignore[arg-type]
    t = Twin("sync", decode_base_url=[DECODE, DECODE2], migrate_non_streamed=True)
    assert t.client.pd_options.migrate_non_streamed is True
    assert t.client.with_options(migrate_non_streamed=False).pd_options.migrate_non_streamed is False


async def test_an_error_in_a_non_streamed_calls_events_is_an_error(mode: str, pool: FakeVLLM) -> None:
    def failing(request: httpx.Request) -> httpx.Response:
        pool.decode_bodies.append(json.loads(request.content))
        role = {"id": "chatcmpl-e", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        events = [role, {"error": {"message": "engine dead", "type": "InternalServerError", "code": 500}}]
        content = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=content, headers={"content-type": "text/event-stream"})

    pool.router.routes["decode"].mock(side_effect=failing)
    t, legs = twin(mode, migrate_non_streamed=True)
    with pytest.raises(openai.APIConnectionError):
        await t.chat(messages=MESSAGES)
    (trace,) = legs.traces
    assert trace.outcome.value == "failed" and "the decode reported an error in its stream: engine dead" in (
        trace.error or ""
    )
    await t.close()


# -- the setting -------------------------------------------------------------------------------


def test_the_setting_is_validated_and_carried_by_with_options() -> None:
    assert PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODE).max_decode_migrations == 1
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(PDConfigError, match="max_decode_migrations must be an int >= 0"):
            PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODE, max_decode_migrations=bad)
    t = Twin("sync", decode_base_url=[DECODE, DECODE2], max_decode_migrations=3)
    assert t.client.pd_options.max_decode_migrations == 3
    assert t.client.with_options(max_decode_migrations=0).pd_options.max_decode_migrations == 0


@pytest.mark.parametrize("bad", [-1, "1", True, 0.5])
async def test_a_bad_per_call_setting_is_a_400(mode: str, pool: FakeVLLM, bad: Any) -> None:
    t, _ = twin(mode)
    with pytest.raises(openai.BadRequestError, match=r"pdclient\.max_decode_migrations must be"):
        await chunks(t, extra_body={"pdclient": {"max_decode_migrations": bad}})
    assert pool.prefill_bodies == []
    await t.close()


def test_the_route_decision_is_one_threshold() -> None:
    assert migrate.continuation_route(migrate.REMOTE_PREFILL_MIN_TOKENS - 1) is migrate.Route.DECODE
    assert migrate.continuation_route(migrate.REMOTE_PREFILL_MIN_TOKENS) is migrate.Route.PREFILL_DECODE


# -- metrics and spans ----------------------------------------------------------------------------


async def test_prometheus_counts_migrations(mode: str, pool: FakeVLLM) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from pdclient.metrics import PrometheusObserver

    registry = prometheus_client.CollectorRegistry()
    metrics = PrometheusObserver(registry)
    pool.cuts = [3]
    t = Twin(mode, decode_base_url=[DECODE, DECODE2], routing="round_robin", observers=[metrics])
    assert text_of(await chunks(t)) == ANSWER
    await t.close()
    value = registry.get_sample_value
    assert value("pdclient_decode_migrations_total", {"route": "chat", "via": "decode"}) == 1
    assert value("pdclient_decode_migration_pause_seconds_count", {"route": "chat"}) == 1
    assert value("pdclient_calls_total", {"route": "chat", "outcome": "disaggregated"}) == 1
    decode_legs = {"leg": "decode", "endpoint": DECODE, "status": "error"}
    assert value("pdclient_leg_duration_seconds_count", decode_legs) == 1
    assert value("pdclient_leg_duration_seconds_count", {**decode_legs, "endpoint": DECODE2, "status": "200"}) == 1


async def test_otel_shows_the_move(mode: str, pool: FakeVLLM) -> None:
    pytest.importorskip("opentelemetry.sdk")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from pdclient.otel import OTelObserver

    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    pool.cuts = [4]
    t = Twin(
        mode,
        decode_base_url=[DECODE, DECODE2],
        routing="round_robin",
        observers=[OTelObserver(tracer_provider=provider)],
    )
    assert text_of(await chunks(t)) == ANSWER
    await t.close()
    finished = {s.name: s for s in spans.get_finished_spans() if s.name != "pdclient.decode"}
    decode_spans = [s for s in spans.get_finished_spans() if s.name == "pdclient.decode"]
    assert [(s.attributes or {})["pdclient.attempt"] for s in decode_spans] == [1, 2]
    assert [(s.attributes or {}).get("url.full", "").split("/")[2] for s in decode_spans] == [
        "decode.test:8200",
        "decode2.test:8200",
    ]
    call = finished["pdclient.chat"]
    assert (call.attributes or {})["pdclient.migrations"] == 1
    (event,) = call.events
    attributes = event.attributes or {}
    assert event.name == "pdclient.migration" and attributes["pdclient.after_tokens"] == 3
    assert (attributes["pdclient.from_url"], attributes["pdclient.to_url"]) == (DECODE, DECODE2)
    provider.shutdown()


class Recording:
    """A routing policy that picks in list order and remembers what it was told was routed."""

    name = "recording"

    def __init__(self) -> None:
        self.routed: list[str] = []

    def choose(self, endpoints: Any, request: Any) -> Any:
        return endpoints[0]

    def on_routed(self, endpoint: Any, request: Any) -> None:
        self.routed.append(endpoint.url)


class Decisions(PDObserver):
    def __init__(self) -> None:
        self.decode_routes: list[str | None] = []

    def on_leg_start(self, call: CallView, leg: LegView) -> None:
        if leg.name == "decode":
            self.decode_routes.append(str(leg.decision) if leg.decision is not None else None)


async def test_a_continuation_takes_its_endpoint_through_the_policy_as_a_first_pick_does(
    mode: str, pool: FakeVLLM
) -> None:
    """The continuation's endpoint is routed as any leg's is: the policy's on_routed hears of it,
    observers see its decision, and the trace's decode_route is the endpoint that answered."""
    pool.cuts = [3]
    policy, decisions, legs = Recording(), Decisions(), Legs()
    t = Twin(mode, decode_base_url=[DECODE, DECODE2], decode_routing=policy, observers=[legs, decisions])
    received = await chunks(t, max_tokens=20)
    assert text_of(received) == ANSWER
    assert pool.decode_urls == [DECODE, DECODE2]
    assert policy.routed == [DECODE, DECODE2]
    assert len(decisions.decode_routes) == 2 and all(r is not None for r in decisions.decode_routes)
    (trace,) = legs.traces
    assert trace.decode_url == DECODE2 and trace.decode_route == "recording"
