"""Merging the two legs' usage into the caller's: pure functions on bytes.

The payloads are the ones vLLM 0.32 returned on the local NIXL pair for a follow-up turn
(``--enable-prompt-tokens-details``), trimmed to what matters.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdclient.wire import (
    UsageMerge,
    UsageStrip,
    merge_usage,
    merge_usage_json,
    merge_usage_sse,
    prefill_usage,
    with_usage_asked,
)

# The prefill leg of a P/D follow-up: 1280 of its 1493 ids were in its prefix cache.
PREFILL_RESPONSE: dict[str, Any] = {
    "id": "chatcmpl-p",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "The"}, "finish_reason": "length"}],
    "usage": {
        "prompt_tokens": 1493,
        "total_tokens": 1494,
        "completion_tokens": 1,
        "prompt_tokens_details": {"cached_tokens": 1280, "created_cache_tokens": 128, "multimodal_tokens": None},
        "completion_tokens_details": None,
    },
    "prompt_token_ids": list(range(1493)),
    "kv_transfer_params": {"remote_block_ids": [[1, 2, 3]], "remote_prefill_cached_tokens": 1280},
}
# Its decode leg's final usage chunk: vLLM 0.32 already reports the prefill's hits, but
# not what the prefill newly cached.
DECODE_USAGE: dict[str, Any] = {
    "prompt_tokens": 1493,
    "total_tokens": 1501,
    "completion_tokens": 8,
    "prompt_tokens_details": {"cached_tokens": 1280, "created_cache_tokens": 0},
}
MERGED: dict[str, Any] = {
    "prompt_tokens": 1493,
    "total_tokens": 1501,
    "completion_tokens": 8,
    "prompt_tokens_details": {"cached_tokens": 1280, "created_cache_tokens": 128, "multimodal_tokens": None},
}


def usage_chunk(usage: dict[str, Any]) -> bytes:
    chunk = {"id": "chatcmpl-d", "object": "chat.completion.chunk", "model": "m", "choices": [], "usage": usage}
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


CONTENT_CHUNK = b'data: {"id":"chatcmpl-d","choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}\n\n'
DONE = b"data: [DONE]\n\n"


def test_prefill_usage_keeps_only_the_input_side() -> None:
    assert prefill_usage(PREFILL_RESPONSE) == {
        "prompt_tokens": 1493,
        "prompt_tokens_details": PREFILL_RESPONSE["usage"]["prompt_tokens_details"],
    }
    assert prefill_usage({"usage": {"prompt_tokens": 9, "completion_tokens": 1}}) == {"prompt_tokens": 9}
    for payload in (None, [], {}, {"usage": None}, {"usage": {"prompt_tokens": "9"}}, {"usage": {"prompt_tokens": -1}}):
        assert prefill_usage(payload) is None


def test_the_input_side_comes_from_the_prefill_the_output_side_from_the_decode() -> None:
    assert merge_usage(prefill_usage(PREFILL_RESPONSE), DECODE_USAGE) == MERGED


def test_an_older_decode_server_counting_the_pulled_kv_as_cached_is_corrected() -> None:
    decode = {**DECODE_USAGE, "prompt_tokens_details": {"cached_tokens": 1493}}
    assert merge_usage(prefill_usage(PREFILL_RESPONSE), decode)["prompt_tokens_details"]["cached_tokens"] == 1280


def test_the_prefills_forced_token_is_never_counted() -> None:
    merged = merge_usage({"prompt_tokens": 10}, {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13})
    assert (merged["completion_tokens"], merged["total_tokens"]) == (3, 13)


def test_without_prefill_details_a_decode_cached_count_is_dropped() -> None:
    decode = {
        "prompt_tokens": 10,
        "completion_tokens": 2,
        "total_tokens": 12,
        "prompt_tokens_details": {"cached_tokens": 10},
    }
    assert "prompt_tokens_details" not in merge_usage({"prompt_tokens": 10}, decode)
    decode["prompt_tokens_details"] = {"cached_tokens": 10, "audio_tokens": 0}
    assert merge_usage({"prompt_tokens": 10}, decode)["prompt_tokens_details"] == {"audio_tokens": 0}


def test_a_decode_only_call_keeps_its_own_usage() -> None:
    assert merge_usage(None, DECODE_USAGE) == DECODE_USAGE
    assert merge_usage({"prompt_tokens": "x"}, DECODE_USAGE) == DECODE_USAGE


def test_decode_usage_without_counts_keeps_its_total() -> None:
    merged = merge_usage({"prompt_tokens": 5}, {"prompt_tokens": 5, "total_tokens": 7})
    assert merged == {"prompt_tokens": 5, "total_tokens": 7}


# -- bytes ----------------------------------------------------------------------------


def test_a_non_streamed_body_is_rewritten() -> None:
    body = json.dumps({"id": "d", "choices": [], "usage": DECODE_USAGE}).encode()
    assert json.loads(merge_usage_json(body, prefill_usage(PREFILL_RESPONSE)))["usage"] == MERGED


@pytest.mark.parametrize("body", [b"not json", b'{"usage": null}', b"[1]", b'{"id": "d"}'])
def test_a_body_without_usage_comes_back_as_is(body: bytes) -> None:
    assert merge_usage_json(body, prefill_usage(PREFILL_RESPONSE)) is body


def test_a_body_whose_usage_needs_nothing_comes_back_as_is() -> None:
    body = json.dumps({"usage": MERGED}).encode()
    assert merge_usage_json(body, prefill_usage(PREFILL_RESPONSE)) is body
    assert merge_usage_json(body, None) is body


def test_the_last_sse_chunk_gets_its_usage_event_rewritten_and_nothing_else() -> None:
    last = CONTENT_CHUNK + usage_chunk(DECODE_USAGE) + DONE
    rewritten = merge_usage_sse(last, prefill_usage(PREFILL_RESPONSE))
    assert rewritten.startswith(CONTENT_CHUNK) and rewritten.endswith(b"\n\n" + DONE)
    events = [e for e in rewritten.split(b"\n\n") if e]
    assert json.loads(events[1][len(b"data: ") :])["usage"] == MERGED
    assert len(events) == 3


def test_crlf_events_and_extra_fields_keep_their_framing() -> None:
    event = b"event: message\r\n" + usage_chunk(DECODE_USAGE).replace(b"\n\n", b"\r\n\r\n")
    rewritten = merge_usage_sse(event + b"data: [DONE]\r\n\r\n", prefill_usage(PREFILL_RESPONSE))
    assert rewritten.startswith(b"event: message\r\ndata: {")
    assert rewritten.endswith(b"}\r\n\r\ndata: [DONE]\r\n\r\n")
    data = rewritten.split(b"\r\n")[1]
    assert json.loads(data[len(b"data: ") :])["usage"]["prompt_tokens_details"]["created_cache_tokens"] == 128


def test_per_chunk_usage_and_partial_events_are_left_alone() -> None:
    continuous = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}],"usage":{"prompt_tokens":1493}}\n\n'
    partial = usage_chunk(DECODE_USAGE)[:-2]  # its blank line has not arrived yet
    for data in (continuous, partial, CONTENT_CHUNK + DONE, b"data: {not json}\n\n", b'data: {"usage": 1}\n\n'):
        assert merge_usage_sse(data, prefill_usage(PREFILL_RESPONSE)) is data


def test_sse_without_a_prefill_usage_is_untouched() -> None:
    data = usage_chunk(DECODE_USAGE) + DONE
    assert merge_usage_sse(data, None) is data


def test_a_split_usage_event_is_rewritten_once_whole() -> None:
    whole = usage_chunk(DECODE_USAGE) + DONE
    head, tail = whole[:40], whole[40:]
    prefill = prefill_usage(PREFILL_RESPONSE)
    assert merge_usage_sse(head, prefill) is head  # the caller keeps bytes until an event is whole
    assert json.loads(merge_usage_sse(head + tail, prefill).split(b"\n\n")[0][6:])["usage"] == MERGED


@pytest.mark.parametrize("size", [1, 5, 17, 64, 10_000])
def test_a_stream_merged_in_pieces_of_any_size_is_the_stream_merged_whole(size: int) -> None:
    body = CONTENT_CHUNK * 3 + usage_chunk(DECODE_USAGE) + DONE
    prefill = prefill_usage(PREFILL_RESPONSE)
    assert prefill is not None
    merge = UsageMerge(prefill, stream=True)
    out = [merge.feed(body[i : i + size]) for i in range(0, len(body), size)]
    out.append(merge.end())
    assert b"".join(out) == merge_usage_sse(body, prefill)
    assert all(piece.endswith(b"\n\n") for piece in out if piece), "only whole events go on"


def test_a_json_body_is_held_until_whole_then_merged() -> None:
    body = json.dumps({"id": "c", "choices": [], "usage": DECODE_USAGE}).encode()
    merge = UsageMerge(prefill_usage(PREFILL_RESPONSE) or {}, stream=False)
    assert merge.feed(body[:10]) == b"" and merge.feed(body[10:]) == b""
    assert json.loads(merge.end())["usage"] == MERGED


# -- the usage pdclient asks for itself ---------------------------------------------------


def test_with_usage_asked_adds_stream_options_without_re_encoding() -> None:
    body = b'{"model":"m","messages":[],"stream":true}'
    assert json.loads(with_usage_asked(body))["stream_options"] == {"include_usage": True}
    assert with_usage_asked(body).startswith(body[:-1])
    assert with_usage_asked(b"not json") == b"not json"


@pytest.mark.parametrize(
    ("options", "sent"),
    [
        ({"include_usage": False}, {"include_usage": True}),
        ({"include_usage": False, "continuous_usage_stats": True}, {"include_usage": True}),
        ({"continuous_usage_stats": True, "x": 1}, {"include_usage": True, "x": 1}),
        (None, {"include_usage": True}),
        ("not options", "not options"),
    ],
    ids=["turned-off", "continuous-too", "other-keys-kept", "null", "not-an-object"],
)
def test_with_usage_asked_turns_usage_on_in_the_callers_own_options(options: object, sent: object) -> None:
    """Usage in every chunk stays the caller's to ask for; options that are not an object go
    to the server as they are, for it to refuse."""
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream_options": options})
    asked = json.loads(with_usage_asked(body.encode()))
    assert asked["stream_options"] == sent
    assert asked["messages"] == [{"role": "user", "content": "hi"}] and asked["model"] == "m"


def test_usage_strip_takes_out_the_usage_event_only_across_reads() -> None:
    content = b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    usage_event = b'data: {"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1}}\n\n'
    stream = content + usage_event + b"data: [DONE]\n\n"
    for cut in range(1, len(stream)):
        strip = UsageStrip()
        out = strip.feed(stream[:cut]) + strip.feed(stream[cut:]) + strip.end()
        assert out == content + b"data: [DONE]\n\n"
