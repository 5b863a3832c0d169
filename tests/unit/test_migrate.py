"""The decode-migration tracker on bytes (pdclient/_migrate.py): events in, the caller's bytes out."""

from __future__ import annotations

import json
from typing import Any

from pdclient._migrate import Tracker


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
