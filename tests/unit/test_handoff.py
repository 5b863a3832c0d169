"""The pure planning functions: no HTTP at all."""

from __future__ import annotations

import copy

import pytest

from pdclient._handoff import (
    PREFILL_KV_TRANSFER_PARAMS,
    Kind,
    PrefillResult,
    handoff_refusal,
    ids_not_forwarded_because,
    plan_decode,
    plan_prefill,
    read_prefill,
    route_kind,
)

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
NIXL_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [1, 2],
    "remote_engine_id": "engine-1",
    "remote_request_id": "r-1",
    "remote_host": "10.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}


@pytest.mark.parametrize(
    ("path", "kind"),
    [
        ("/chat/completions", Kind.CHAT),
        ("/chat/completions/", Kind.CHAT),
        ("/completions", Kind.COMPLETIONS),
        ("/models", None),
        ("/embeddings", None),
        ("/chat/completions/abc", None),
    ],
)
def test_route_kind(path: str, kind: Kind | None) -> None:
    assert route_kind(path) is kind


def test_prefill_body_is_a_one_token_non_streamed_call() -> None:
    body = {
        "model": "m",
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 512,
        "max_completion_tokens": 512,
        "min_tokens": 8,
        "n": 3,
        "temperature": 0.7,
    }
    original = copy.deepcopy(body)
    prefill = plan_prefill(Kind.CHAT, body)
    assert prefill == {
        "model": "m",
        "messages": MESSAGES,
        "stream": False,
        "max_tokens": 1,
        "max_completion_tokens": 1,
        "n": 1,
        "temperature": 0.7,
        "return_token_ids": True,
        "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS),
    }
    assert body == original, "the caller's body is never mutated"


def test_prefill_keeps_everything_that_shapes_the_prompt() -> None:
    shaping = {
        "tools": TOOLS,
        "tool_choice": "auto",
        "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_object"},
        "add_generation_prompt": True,
        "top_k": 1,
    }
    prefill = plan_prefill(Kind.CHAT, {"model": "m", "messages": MESSAGES, **shaping})
    for key, value in shaping.items():
        assert prefill[key] == value
    assert "max_completion_tokens" not in prefill, "only set when the caller used it"


def test_prefill_takes_the_single_prompt_of_a_one_item_batch() -> None:
    assert plan_prefill(Kind.COMPLETIONS, {"model": "m", "prompt": ["Hello"]})["prompt"] == "Hello"
    assert plan_prefill(Kind.COMPLETIONS, {"model": "m", "prompt": [[1, 2]]})["prompt"] == [1, 2]


@pytest.mark.parametrize(
    ("kind", "body", "reason"),
    [
        (Kind.CHAT, {"messages": MESSAGES}, None),
        (Kind.CHAT, {"messages": MESSAGES, "kv_transfer_params": {}}, "kv_transfer_params is written by pdclient"),
        (Kind.COMPLETIONS, {"prompt": "x"}, None),
        (Kind.COMPLETIONS, {"prompt": [1, 2, 3]}, None),
        (Kind.COMPLETIONS, {"prompt": ["x"]}, None),
        (Kind.COMPLETIONS, {"prompt": ["x", "y"]}, "not a batch"),
        (Kind.COMPLETIONS, {"prompt": [[1], [2]]}, "not a batch"),
        (Kind.COMPLETIONS, {"prompt": []}, "not a batch"),
        (Kind.COMPLETIONS, {}, "not a batch"),
    ],
)
def test_handoff_refusal(kind: Kind, body: dict[str, object], reason: str | None) -> None:
    refusal = handoff_refusal(kind, body)
    if reason is None:
        assert refusal is None
    else:
        assert refusal is not None and reason in refusal


@pytest.mark.parametrize(
    ("kind", "body", "reason"),
    [
        (Kind.CHAT, {"messages": MESSAGES}, None),
        (Kind.CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, None),
        (
            Kind.CHAT,
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]},
            "media",
        ),
        (Kind.CHAT, {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "media"),
        (Kind.CHAT, {"messages": [{"role": "user", "content": [{"type": "video_url"}]}]}, "media"),
        (Kind.CHAT, {"messages": [{"role": "user", "content": [{"type": "file"}]}]}, "media"),
        (Kind.CHAT, {"messages": MESSAGES, "echo": True}, "echo"),
        (Kind.COMPLETIONS, {"prompt": "x", "echo": True}, "echo"),
        (Kind.COMPLETIONS, {"prompt": "x", "echo": False}, None),
    ],
)
def test_ids_not_forwarded_because(kind: Kind, body: dict[str, object], reason: str | None) -> None:
    assert ids_not_forwarded_because(kind, body) == reason


def test_read_prefill_chat_and_completions() -> None:
    chat = read_prefill(Kind.CHAT, {"prompt_token_ids": [5, 6], "kv_transfer_params": NIXL_PARAMS})
    assert chat == PrefillResult([5, 6], NIXL_PARAMS)
    completions = read_prefill(Kind.COMPLETIONS, {"choices": [{"prompt_token_ids": [7]}], "kv_transfer_params": None})
    assert completions == PrefillResult([7], None)


@pytest.mark.parametrize(
    ("payload", "problem"),
    [
        ({}, "no prompt_token_ids"),
        ({"prompt_token_ids": None}, "no prompt_token_ids"),
        ({"prompt_token_ids": []}, "not a non-empty list"),
        ({"prompt_token_ids": [1, -2]}, "not a non-empty list"),
        ({"prompt_token_ids": [1, "2"]}, "not a non-empty list"),
        ({"prompt_token_ids": [1, 2.0]}, "not a non-empty list"),
        ({"prompt_token_ids": [True]}, "not a non-empty list"),
        ({"prompt_token_ids": "1,2"}, "not a non-empty list"),
        ([1, 2], "not a JSON object"),
        (None, "not a JSON object"),
    ],
)
def test_read_prefill_rejects_what_is_not_ids(payload: object, problem: str) -> None:
    result = read_prefill(Kind.CHAT, payload)
    assert result.prompt_token_ids is None
    assert result.problem is not None and problem in result.problem


def test_read_prefill_keeps_kv_params_when_ids_are_missing_and_drops_non_dicts() -> None:
    assert read_prefill(Kind.CHAT, {"kv_transfer_params": NIXL_PARAMS}).kv_transfer_params == NIXL_PARAMS
    assert read_prefill(Kind.CHAT, {"prompt_token_ids": [1], "kv_transfer_params": "x"}).kv_transfer_params is None
    assert read_prefill(Kind.COMPLETIONS, {"choices": []}).problem == "prefill response has no prompt_token_ids"


def test_decode_body_is_the_callers_plus_the_whole_kv_params_and_the_ids() -> None:
    body = {
        "model": "m",
        "messages": MESSAGES,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 64,
        "min_tokens": 2,
        "n": 2,
        "tools": TOOLS,
        "top_k": 1,
    }
    original = copy.deepcopy(body)
    decode = plan_decode(Kind.CHAT, body, PrefillResult([1, 2, 3], NIXL_PARAMS), forward_ids=True)
    assert decode == {**body, "kv_transfer_params": {**NIXL_PARAMS, "prompt_token_ids": [1, 2, 3]}}
    assert body == original and "prompt_token_ids" not in NIXL_PARAMS


def test_decode_body_without_connector_still_forwards_ids() -> None:
    decode = plan_decode(Kind.CHAT, {"messages": MESSAGES}, PrefillResult([1, 2], None), forward_ids=True)
    assert decode["kv_transfer_params"] == {"prompt_token_ids": [1, 2]}


def test_decode_body_for_media_or_echo_keeps_kv_params_but_not_ids() -> None:
    decode = plan_decode(Kind.CHAT, {"messages": MESSAGES}, PrefillResult([1, 2], NIXL_PARAMS), forward_ids=False)
    assert decode["kv_transfer_params"] == NIXL_PARAMS
    bare = plan_decode(Kind.CHAT, {"messages": MESSAGES}, PrefillResult([1, 2], None), forward_ids=False)
    assert bare == {"messages": MESSAGES}


def test_decode_body_without_prefill_is_the_callers_body() -> None:
    assert plan_decode(Kind.CHAT, {"messages": MESSAGES}, None, forward_ids=True) == {"messages": MESSAGES}


def test_decode_body_when_the_prefill_gave_no_ids() -> None:
    decode = plan_decode(Kind.CHAT, {"messages": MESSAGES}, PrefillResult(None, NIXL_PARAMS, "x"), forward_ids=True)
    assert decode["kv_transfer_params"] == NIXL_PARAMS


def test_completions_decode_prompt_becomes_the_ids() -> None:
    body = {"model": "m", "prompt": "Once upon", "max_tokens": 8, "echo": False}
    decode = plan_decode(Kind.COMPLETIONS, body, PrefillResult([9, 8], NIXL_PARAMS), forward_ids=True)
    assert decode == {**body, "prompt": [9, 8], "kv_transfer_params": NIXL_PARAMS}
    echo = plan_decode(Kind.COMPLETIONS, {**body, "echo": True}, PrefillResult([9, 8], None), forward_ids=False)
    assert echo["prompt"] == "Once upon" and "kv_transfer_params" not in echo
