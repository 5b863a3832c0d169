"""The wire contract on bytes: no HTTP at all."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from pdclient.wire import (
    PREFILL_KV_TRANSFER_PARAMS,
    Kind,
    Plan,
    PrefillResult,
    Refusal,
    decode_body,
    plan_call,
    prefill_body,
    read_prefill,
    release_body,
    route_kind,
    without_call_options,
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


def plan(kind: Kind, body: dict[str, Any]) -> Plan:
    return plan_call(kind, orjson.dumps(body))


def result(ids: list[int] | None, kv: dict[str, Any] | None = NIXL_PARAMS) -> PrefillResult:
    return PrefillResult(
        None if ids is None else orjson.dumps(ids), len(ids or ()), None if kv is None else orjson.dumps(kv)
    )


def chat_response(ids: object, kv: object = NIXL_PARAMS, **extra: Any) -> bytes:
    payload = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}, "token_ids": [7]}],
        "prompt_token_ids": ids,
        "kv_transfer_params": kv,
        **extra,
    }
    # vLLM's JSONResponse writes compact JSON (separators=(",", ":")).
    return json.dumps(payload, separators=(",", ":")).encode()


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
    assert orjson.loads(prefill_body(plan(Kind.CHAT, body))) == {
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


def test_prefill_keeps_everything_that_shapes_the_prompt() -> None:
    shaping = {
        "tools": TOOLS,
        "tool_choice": "auto",
        "chat_template_kwargs": {"enable_thinking": False},
        "response_format": {"type": "json_object"},
        "add_generation_prompt": True,
        "top_k": 1,
    }
    prefill = orjson.loads(prefill_body(plan(Kind.CHAT, {"model": "m", "messages": MESSAGES, **shaping})))
    for key, value in shaping.items():
        assert prefill[key] == value
    assert "max_completion_tokens" not in prefill, "only set when the caller used it"


def test_fields_reach_both_legs_byte_for_byte() -> None:
    """An integer beyond 64 bits, odd spacing and non-ASCII stay exactly as the caller wrote them."""
    tool_schema = b'{"type":"integer","maximum":100000000000000000000, "x" : 1.50}'
    content = (
        b'{"model":"m","messages":[{"role":"user","content":"caf\\u00e9 \xc3\xa9"}],"tools":[{"type":"function",'
        b'"function":{"name":"f","parameters":' + tool_schema + b"}}]}"
    )
    the_plan = plan_call(Kind.CHAT, content)
    for leg in (prefill_body(the_plan), decode_body(the_plan, result([1, 2]))):
        assert tool_schema in leg
        assert b'"content":"caf\\u00e9 \xc3\xa9"' in leg


def test_completions_single_item_batch_is_one_prompt_on_both_legs() -> None:
    for prompt, single in ((["Hello"], "Hello"), ([[1, 2]], [1, 2])):
        the_plan = plan(Kind.COMPLETIONS, {"model": "m", "prompt": prompt})
        assert orjson.loads(prefill_body(the_plan))["prompt"] == single
        assert orjson.loads(decode_body(the_plan, None))["prompt"] == single


@pytest.mark.parametrize(
    ("kind", "body", "reason"),
    [
        (Kind.CHAT, {"messages": MESSAGES, "kv_transfer_params": {}}, "kv_transfer_params is written by pdclient"),
        (Kind.CHAT, {"model": "m"}, "messages: a chat call needs a list"),
        (Kind.COMPLETIONS, {"prompt": ["x", "y"]}, "not a batch"),
        (Kind.COMPLETIONS, {"prompt": [[1], [2]]}, "not a batch"),
        (Kind.COMPLETIONS, {"prompt": []}, "not a batch"),
        (Kind.COMPLETIONS, {}, "not a batch"),
        (Kind.CHAT, {"messages": MESSAGES, "pdclient": {"on_prefil_failure": "fail"}}, "pdclient.on_prefil_failure"),
        (Kind.CHAT, {"messages": MESSAGES, "pdclient": {"forward_ids": "no"}}, "pdclient.forward_ids must be a bool"),
        (Kind.CHAT, {"messages": MESSAGES, "pdclient": ["fail"]}, "pdclient must be an object"),
    ],
)
def test_refusals_name_what_is_wrong(kind: Kind, body: dict[str, object], reason: str) -> None:
    with pytest.raises(Refusal, match=reason.replace(".", r"\.")):
        plan(kind, body)


@pytest.mark.parametrize("content", [b"", b"[1]", b"{", b'"x"', b"\xff\xfe{}"])
def test_a_body_that_is_not_a_json_object_is_refused(content: bytes) -> None:
    with pytest.raises(Refusal, match="request body is not a JSON object"):
        plan_call(Kind.CHAT, content)


@pytest.mark.parametrize(
    ("kind", "body", "skipped"),
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
        (Kind.CHAT, {"messages": MESSAGES, "pdclient": {"forward_ids": False}}, "forward_ids off"),
    ],
)
def test_ids_skipped(kind: Kind, body: dict[str, object], skipped: str | None) -> None:
    assert plan(kind, body).ids_skipped == skipped


def test_call_options_never_reach_a_leg() -> None:
    the_plan = plan(Kind.CHAT, {"messages": MESSAGES, "pdclient": {"session": "u-1", "on_prefill_failure": "fail"}})
    assert the_plan.options.session == "u-1" and the_plan.options.on_prefill_failure == "fail"
    assert the_plan.affinity_key == "session:u-1"
    for leg in (prefill_body(the_plan), decode_body(the_plan, result([1])), release_body(the_plan, result([1]))):
        assert b'"pdclient"' not in leg


def test_pass_through_body_loses_only_the_call_options() -> None:
    content = b'{"input":"hi","n":100000000000000000000,"pdclient":{"session":"s"}}'
    assert without_call_options(content) == b'{"input":"hi","n":100000000000000000000}'
    untouched = b'{"input": "pdclient"}'
    assert without_call_options(untouched) is untouched
    with pytest.raises(Refusal, match=r"pdclient\.nope is not a per-call option"):
        without_call_options(b'{"pdclient":{"nope":1}}')


def test_affinity_key_is_the_conversation_opening() -> None:
    first = plan(Kind.CHAT, {"messages": MESSAGES})
    later = plan(Kind.CHAT, {"messages": [*MESSAGES, {"role": "assistant", "content": "Hello"}]})
    other = plan(Kind.CHAT, {"messages": [MESSAGES[0], {"role": "user", "content": "Bye"}]})
    assert first.affinity_key == later.affinity_key != other.affinity_key


# -- the prefill's answer ------------------------------------------------------------------


def test_read_prefill_chat_and_completions() -> None:
    chat = read_prefill(Kind.CHAT, chat_response([5, 6]))
    assert chat == PrefillResult(b"[5,6]", 2, orjson.dumps(NIXL_PARAMS))
    completion = {"choices": [{"index": 0, "text": "x", "prompt_token_ids": [7]}], "kv_transfer_params": None}
    assert read_prefill(Kind.COMPLETIONS, orjson.dumps(completion)) == PrefillResult(b"[7]", 1, None)


def test_read_prefill_takes_the_top_level_ids_not_a_lookalike() -> None:
    """A message text or a nested key that spells the field cannot stand in for it."""
    decoy = chat_response([5, 6], prompt_logprobs={"prompt_token_ids": [9, 9, 9]})
    assert read_prefill(Kind.CHAT, decoy).ids == b"[5,6]"
    content = json.dumps({"prompt_token_ids": [1], "x": 'a "prompt_token_ids":[4]'}, separators=(",", ":"))
    assert read_prefill(Kind.CHAT, content.encode()).ids == b"[1]"


def test_read_prefill_cuts_the_ids_out_when_a_lookalike_follows_them() -> None:
    """The top-level ids come first in the body and a nested key spelling the field after
    them: the ids are still cut out of the bytes, not parsed, so the KV transfer parameters
    pass on as the server wrote them."""
    kv = b'{"remote_host": "h", "prompt_token_ids": [9]}'
    content = b'{"prompt_token_ids":[5,6],"kv_transfer_params":' + kv + b"}"
    assert read_prefill(Kind.CHAT, content) == PrefillResult(b"[5,6]", 2, kv)


def test_read_prefill_counts_compact_ids_with_or_without_the_servers_count() -> None:
    assert read_prefill(Kind.CHAT, b'{"prompt_token_ids":[10,2,33]}') == PrefillResult(b"[10,2,33]", 3, None)
    assert read_prefill(Kind.CHAT, b'{"prompt_token_ids":[7]}') == PrefillResult(b"[7]", 1, None)
    counted = b'{"prompt_token_ids":[1,2],"usage":{"prompt_tokens":2}}'
    assert read_prefill(Kind.CHAT, counted) == PrefillResult(b"[1,2]", 2, None)
    miscounted = read_prefill(Kind.CHAT, b'{"prompt_token_ids":[1,2],"usage":{"prompt_tokens":3}}')
    assert miscounted.ids == b"[1,2]" and miscounted.count == 2  # the exact path's own count


def test_read_prefill_accepts_json_that_is_not_compact() -> None:
    spaced = json.dumps({"prompt_token_ids": [1, 2, 3], "kv_transfer_params": NIXL_PARAMS}, indent=2).encode()
    parsed = read_prefill(Kind.CHAT, spaced)
    assert parsed.ids == b"[1,2,3]" and parsed.count == 3
    assert parsed.kv_transfer_params is not None and orjson.loads(parsed.kv_transfer_params) == NIXL_PARAMS


@pytest.mark.parametrize(
    ("ids", "problem"),
    [
        (None, "no prompt_token_ids"),
        ([], "not a non-empty list"),
        ([1, -2], "not a non-empty list"),
        ([1, "2"], "not a non-empty list"),
        ([1, 2.0], "not a non-empty list"),
        ([True], "not a non-empty list"),
        ([[1]], "not a non-empty list"),
        ("1,2", "not a non-empty list"),
    ],
)
def test_read_prefill_rejects_what_is_not_ids(ids: object, problem: str) -> None:
    parsed = read_prefill(Kind.CHAT, chat_response(ids))
    assert parsed.ids is None and parsed.count == 0
    assert parsed.problem is not None and problem in parsed.problem


@pytest.mark.parametrize(
    "content",
    [
        b"[1,2]",
        b"null",
        b"{not json",
        b'{"prompt_token_ids":[1,,2]}',
        b'{"prompt_token_ids":[1,2,]}',
        b'{"prompt_token_ids":[,1]}',
        b'{"prompt_token_ids":[1,-2]}',
        b'{"prompt_token_ids":[[1],2]}',
        b'{"prompt_token_ids":[]}',
        b"\xff",
    ],
)
def test_read_prefill_rejects_what_is_not_a_response(content: bytes) -> None:
    parsed = read_prefill(Kind.CHAT, content)
    assert parsed.ids is None and parsed.problem is not None


def test_read_prefill_keeps_kv_params_when_ids_are_missing_and_drops_non_objects() -> None:
    assert read_prefill(Kind.CHAT, chat_response(None)).kv_transfer_params == orjson.dumps(NIXL_PARAMS)
    assert read_prefill(Kind.CHAT, chat_response([1], kv="x")).kv_transfer_params is None
    assert read_prefill(Kind.COMPLETIONS, b'{"choices":[]}').problem == "prefill response has no prompt_token_ids"


# -- the decode leg ------------------------------------------------------------------------


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
    decode = orjson.loads(decode_body(plan(Kind.CHAT, body), result([1, 2, 3])))
    assert decode == {**body, "kv_transfer_params": {**NIXL_PARAMS, "prompt_token_ids": [1, 2, 3]}}


def test_decode_body_splices_the_prefills_bytes() -> None:
    """The id array and the KV params go from the prefill's response to the decode as they came."""
    response = chat_response([151000, 0, 42], kv={"remote_host": "h", "remote_block_ids": [7]})
    decode = decode_body(plan(Kind.CHAT, {"messages": MESSAGES}), read_prefill(Kind.CHAT, response))
    spliced = b'"kv_transfer_params":{"remote_host":"h","remote_block_ids":[7],"prompt_token_ids":[151000,0,42]}}'
    assert decode.endswith(spliced)


def test_decode_body_without_connector_still_forwards_ids() -> None:
    decode = orjson.loads(decode_body(plan(Kind.CHAT, {"messages": MESSAGES}), result([1, 2], kv=None)))
    assert decode["kv_transfer_params"] == {"prompt_token_ids": [1, 2]}


def test_decode_body_for_media_or_echo_keeps_kv_params_but_not_ids() -> None:
    no_ids = plan(Kind.CHAT, {"messages": MESSAGES, "echo": True})
    assert orjson.loads(decode_body(no_ids, result([1, 2])))["kv_transfer_params"] == NIXL_PARAMS
    assert "kv_transfer_params" not in orjson.loads(decode_body(no_ids, result([1, 2], kv=None)))


def test_decode_body_without_prefill_is_the_callers_body() -> None:
    assert orjson.loads(decode_body(plan(Kind.CHAT, {"messages": MESSAGES}), None)) == {"messages": MESSAGES}


def test_decode_body_when_the_prefill_gave_no_ids() -> None:
    no_ids = PrefillResult(None, 0, orjson.dumps(NIXL_PARAMS), "x")
    decode = orjson.loads(decode_body(plan(Kind.CHAT, {"messages": MESSAGES}), no_ids))
    assert decode["kv_transfer_params"] == NIXL_PARAMS


def test_completions_decode_prompt_becomes_the_ids() -> None:
    body = {"model": "m", "prompt": "Once upon", "max_tokens": 8, "echo": False}
    decode = orjson.loads(decode_body(plan(Kind.COMPLETIONS, body), result([9, 8])))
    assert decode == {**body, "prompt": [9, 8], "kv_transfer_params": NIXL_PARAMS}
    echo = orjson.loads(decode_body(plan(Kind.COMPLETIONS, {**body, "echo": True}), result([9, 8], kv=None)))
    assert echo["prompt"] == "Once upon" and "kv_transfer_params" not in echo


def test_release_is_a_one_token_decode_with_the_handoff() -> None:
    the_plan = plan(Kind.CHAT, {"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": True}})
    release = orjson.loads(release_body(the_plan, result([4, 5])))
    assert release["max_tokens"] == 1 and release["stream"] is False and "stream_options" not in release
    assert release["kv_transfer_params"] == {**NIXL_PARAMS, "prompt_token_ids": [4, 5]}


def test_holds_remote_kv() -> None:
    assert result([1]).holds_remote_kv
    assert not result([1], kv=None).holds_remote_kv
    assert not result([1], kv={}).holds_remote_kv


def test_read_prefill_checks_the_count_against_the_servers_usage() -> None:
    """An empty item is one comma too many against usage.prompt_tokens; any doubt goes to the exact path."""
    assert read_prefill(Kind.CHAT, chat_response([1, 2], usage={"prompt_tokens": 2})).count == 2
    doubled = b'{"prompt_token_ids":[1,,2],"usage":{"prompt_tokens":2}}'
    assert read_prefill(Kind.CHAT, doubled).ids is None
    miscounted = read_prefill(Kind.CHAT, chat_response([1, 2, 3], usage={"prompt_tokens": 2}))
    assert miscounted.ids == b"[1,2,3]" and miscounted.count == 3


@pytest.mark.parametrize("compact", [True, False], ids=["fast-path", "parsed"])
def test_read_prefill_keeps_the_prefills_prompt_tokens_details(compact: bool) -> None:
    details = {"cached_tokens": 256, "created_cache_tokens": 128}
    body: dict[str, Any] = {"prompt_token_ids": [5, 6], "usage": {"prompt_tokens": 2, "prompt_tokens_details": details}}
    content = orjson.dumps(body) if compact else json.dumps(body, indent=1).encode()
    result = read_prefill(Kind.CHAT, content)
    assert result.count == 2 and result.prompt_tokens_details is not None
    assert orjson.loads(result.prompt_tokens_details) == details
    assert read_prefill(Kind.CHAT, orjson.dumps({"prompt_token_ids": [5]})).prompt_tokens_details is None
