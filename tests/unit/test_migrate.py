"""The decode-migration tracker and assembler on bytes (pdclient/migration/): events in, the caller's bytes out."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdclient.migration import Assembler, CannotAssemble, Tracker


def event(choice: dict[str, Any] | None = None, **top: Any) -> bytes:
    body: dict[str, Any] = {"id": "chatcmpl-a", "object": "chat.completion.chunk", "created": 7, "model": "m"}
    body["choices"] = [{"index": 0, "logprobs": None, "finish_reason": None, **choice}] if choice else []
    body.update(top)
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def content(text: str, ids: list[int]) -> bytes:
    return event({"delta": {"content": text}, "token_ids": ids})


def parsed(out: bytes) -> list[dict[str, Any]]:
    return [json.loads(e[6:]) for e in out.split(b"\n\n") if e and e != b"data: [DONE]"]


def test_token_ids_are_cut_out_and_kept() -> None:
    tracker = Tracker(chat=True, keep_ids=False, want_prompt_ids=False)
    role = event({"delta": {"role": "assistant", "content": ""}}, prompt_token_ids=[1, 2, 3])
    out = tracker.feed(role + content("Hi", [10]) + content(" there", [11]))
    assert b"token_ids" not in out
    assert [e["choices"][0]["delta"] for e in parsed(out)] == [
        {"role": "assistant", "content": ""},
        {"content": "Hi"},
        {"content": " there"},
    ]
    assert out.count(b"\n\n") == 3 and tracker.ids == [10, 11] and tracker.header == ("chatcmpl-a", 7, "m")


def test_an_event_split_across_reads_waits_for_its_end() -> None:
    tracker = Tracker(chat=True, keep_ids=False, want_prompt_ids=False)
    whole = content("Hi", [10])
    assert tracker.feed(whole[:20]) == b""
    assert tracker.feed(whole[20:-1]) == b""
    assert parsed(tracker.feed(whole[-1:]))[0]["choices"][0]["delta"] == {"content": "Hi"}
    assert tracker.ids == [10]


def test_a_chunk_without_text_is_held_until_text_follows() -> None:
    tracker = Tracker(chat=True, keep_ids=False, want_prompt_ids=False)
    assert tracker.feed(content("", [50])) == b""
    assert tracker.ids == []
    out = tracker.feed(content("é", [51]))
    assert [e["choices"][0]["delta"]["content"] for e in parsed(out)] == ["", "é"]
    assert tracker.ids == [50, 51]


def test_a_cut_drops_the_held_chunk_and_the_partial_event() -> None:
    tracker = Tracker(chat=True, keep_ids=False, want_prompt_ids=False)
    tracker.feed(content("A", [1]) + content("", [2]) + content("B", [3])[:10])
    tracker.cut()
    assert tracker.ids == [1]
    assert tracker.feed(b"") == b""


def test_the_finish_and_done_flush_what_is_held() -> None:
    tracker = Tracker(chat=True, keep_ids=False, want_prompt_ids=False)
    tracker.feed(content("", [2]))
    out = tracker.feed(event({"delta": {}, "finish_reason": "stop", "token_ids": [0]}) + b"data: [DONE]\n\n")
    assert out.endswith(b"data: [DONE]\n\n") and len(parsed(out)) == 2 and tracker.done


def test_the_callers_own_ids_pass_byte_for_byte() -> None:
    tracker = Tracker(chat=True, keep_ids=True, want_prompt_ids=False)
    role = event({"delta": {"role": "assistant", "content": ""}}, prompt_token_ids=[1, 2, 3])
    data = role + content("Hi", [10])
    assert tracker.feed(data) == data and tracker.ids == [10]


def test_json_in_another_layout_is_re_encoded_without_ids() -> None:
    tracker = Tracker(chat=True, keep_ids=False, want_prompt_ids=False)
    spaced = b'data: {"token_ids": [5], "choices": [{"token_ids": [5], "delta": {"content": "x"}}]}\n\n'
    (only,) = parsed(tracker.feed(spaced))
    assert only["choices"] == [{"delta": {"content": "x"}}] and tracker.ids == [5]


def test_what_stops_the_tracking() -> None:
    cases = [
        (event({"delta": {"tool_calls": [{"index": 0, "function": {"name": "f"}}]}, "token_ids": [1]}), "tool call"),
        (event({"delta": {"reasoning": "hmm"}, "token_ids": [1]}), "reasoning"),
        (event({"delta": {"content": "x"}}), "without its token ids"),
        (b'data: {"error": {"message": "engine dead"}}\n\n', "error in the stream"),
        (b"data: not json\n\n", "not JSON"),
    ]
    for data, reason in cases:
        tracker = Tracker(chat=True, keep_ids=False, want_prompt_ids=False)
        assert tracker.feed(data)
        assert tracker.stopped is not None and reason in tracker.stopped


def test_prompt_ids_are_taken_from_the_first_chunk_when_needed() -> None:
    tracker = Tracker(chat=False, keep_ids=False, want_prompt_ids=True)
    first = b'data: {"id":"cmpl-1","choices":[{"index":0,"text":"A","prompt_token_ids":[4,5],"token_ids":[9]}]}\n\n'
    out = tracker.feed(first)
    assert tracker.prompt_ids == [4, 5] and tracker.ids == [9]
    assert b"token_ids" not in out and json.loads(out[6:])["choices"][0]["text"] == "A"


def test_a_spliced_continuation_reads_as_the_same_stream() -> None:
    tracker = Tracker(chat=True, keep_ids=False, want_prompt_ids=False)
    tracker.feed(event({"delta": {"role": "assistant", "content": ""}}) + content("A", [1]) + content("B", [2]))
    tracker.cut()
    tracker.splice(prompt_tokens=30)
    other = {"id": "chatcmpl-z", "created": 99, "model": "m2"}
    role = event({"delta": {"role": "assistant", "content": ""}}, prompt_token_ids=[7] * 32, **other)
    usage = {"prompt_tokens": 32, "completion_tokens": 1, "total_tokens": 33, "prompt_tokens_details": None}
    out = tracker.feed(role + event({"delta": {"content": "C"}, "token_ids": [3]}, **other) + event(usage=usage))
    events = parsed(out)
    assert [e["choices"][0]["delta"] for e in events[:1]] == [{"content": "C"}], "the role chunk is dropped"
    assert all((e["id"], e["created"], e["model"]) == ("chatcmpl-a", 7, "m") for e in events)
    assert events[-1]["usage"] == {"prompt_tokens": 30, "completion_tokens": 3, "total_tokens": 33}
    assert tracker.ids == [1, 2, 3]


# -- an ended answer ---------------------------------------------------------------------------


def test_an_answer_has_ended_once_every_choice_sent_its_finish_reason() -> None:
    tracker = Tracker(chat=True, keep_ids=False, want_prompt_ids=False)
    tracker.feed(event({"delta": {"role": "assistant", "content": ""}}) + content("A", [1]))
    assert not tracker.answered and tracker.finished == {}
    tracker.feed(event({"delta": {}, "finish_reason": "length", "token_ids": []}))
    assert tracker.answered and tracker.finished == {0: "length"} and not tracker.usage_sent
    tracker.feed(event(usage={"prompt_tokens": 3, "total_tokens": 4, "completion_tokens": 1}))
    assert tracker.usage_sent and not tracker.done

    several = Tracker(chat=False, keep_ids=False, want_prompt_ids=False, choices=2)
    first = b'data: {"id":"c","choices":[{"index":1,"text":"x","finish_reason":"stop","token_ids":[5]}]}\n\n'
    several.feed(first)
    assert several.finished == {1: "stop"} and not several.answered, "the other choice is still going"
    several.feed(first.replace(b'"index":1', b'"index":0'))
    assert several.answered


# -- a non-streamed call's body ------------------------------------------------------------------


def assembled(data: bytes, *, chat: bool = True, keep_ids: bool = False, **kwargs: Any) -> dict[str, Any]:
    assembler = Assembler(chat=chat, keep_ids=keep_ids)
    for i in range(0, len(data), 7):  # in reads that cut events anywhere
        assembler.feed(data[i : i + 7])
    return json.loads(assembler.body(**kwargs))


def test_a_chat_answer_is_assembled_as_vllm_writes_it_non_streamed() -> None:
    def entry(token: str) -> dict[str, Any]:
        return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}

    role = event({"delta": {"role": "assistant", "content": ""}})
    first = event({"delta": {"content": "Hi"}, "logprobs": {"content": [entry("Hi")]}})
    second = event({"delta": {"content": " there"}, "logprobs": {"content": [entry(" there")]}})
    finish = event({"delta": {}, "logprobs": {"content": []}, "finish_reason": "stop", "stop_reason": None})
    usage = event(usage={"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3}, system_fingerprint="fp")
    body = assembled(role + first + second + finish + usage + b"data: [DONE]\n\n")
    message = {
        "role": "assistant",
        "content": "Hi there",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    }
    assert body == {
        "id": "chatcmpl-a",
        "object": "chat.completion",
        "created": 7,
        "model": "m",
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": {"content": [entry("Hi"), entry(" there")]},
                "finish_reason": "stop",
                "stop_reason": None,
                "token_ids": None,
                "routed_experts": None,
            }
        ],
        "service_tier": None,
        "system_fingerprint": "fp",
        "usage": {
            "prompt_tokens": 5,
            "total_tokens": 8,
            "completion_tokens": 3,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
        "prompt_logprobs": None,
        "prompt_token_ids": None,
        "prompt_text": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def test_the_callers_own_ids_are_assembled_and_usage_stands_in_when_none_came() -> None:
    role = event({"delta": {"role": "assistant", "content": ""}, "token_ids": []}, prompt_token_ids=[1, 2])
    data = role + content("A", [10]) + event({"delta": {}, "finish_reason": "length", "token_ids": [11]})
    fallback = {"prompt_tokens": 2, "total_tokens": 4, "completion_tokens": 2}
    body = assembled(data, keep_ids=True, usage=fallback)
    (choice,) = body["choices"]
    assert body["prompt_token_ids"] == [1, 2] and choice["token_ids"] == [10, 11]
    assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert body["usage"] == {**fallback, "prompt_tokens_details": None, "completion_tokens_details": None}


def test_a_completions_answer_is_assembled() -> None:
    def piece(text: str, **extra: Any) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None, **extra}
        body = {"id": "cmpl-a", "object": "text_completion", "created": 7, "model": "m", "choices": [choice]}
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    data = piece("Once", prompt_token_ids=[4, 5], token_ids=[9]) + piece(" upon", token_ids=[10])
    data += piece("", finish_reason="stop", stop_reason=None, token_ids=[2])
    body = assembled(data, chat=False)
    assert body["object"] == "text_completion" and "prompt_token_ids" not in body
    assert body["choices"] == [
        {
            "index": 0,
            "text": "Once upon",
            "logprobs": None,
            "finish_reason": "stop",
            "stop_reason": None,
            "token_ids": None,
            "prompt_logprobs": None,
            "prompt_token_ids": None,
            "routed_experts": None,
        }
    ]
    kept = assembled(data, chat=False, keep_ids=True)["choices"][0]
    assert kept["prompt_token_ids"] == [4, 5] and kept["token_ids"] == [9, 10, 2]


def test_reasoning_and_tool_calls_are_assembled_as_the_sdk_merges_them() -> None:
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}
    data = event({"delta": {"role": "assistant", "content": ""}}) + event({"delta": {"reasoning": "Hmm."}})
    data += event({"delta": {"tool_calls": [call]}})
    data += event({"delta": {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}})
    data += event({"delta": {}, "finish_reason": "tool_calls"})
    message = assembled(data)["choices"][0]["message"]
    assert message["content"] is None and message["reasoning"] == "Hmm."
    assert message["tool_calls"] == [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    ]


def test_what_cannot_be_assembled_says_why() -> None:
    role = event({"delta": {"role": "assistant", "content": ""}})
    cases = [
        (role + b'data: {"error": {"message": "engine dead", "code": 500}}\n\n', "reported an error.*engine dead"),
        (b"data: not json\n\n", "not JSON"),
        (b"data: [1, 2]\n\n", "not a JSON object"),
        (b"", "ended before its first event"),
        (event(usage={"prompt_tokens": 1}), "carried no choice"),
        (event({"index": "0", "delta": {"content": "x"}}), "index is '0'"),
    ]
    for data, reason in cases:
        with pytest.raises(CannotAssemble, match=reason):
            assembled(data)
