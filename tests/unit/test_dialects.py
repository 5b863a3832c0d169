"""The dialects on bytes: routes, the conversation as chat messages, the ids in the prefill's
``kv_transfer_params`` and their checks, and each API's usage merge."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pdclient.dialects import DIALECTS, dialect_for
from pdclient.wire import Kind, Refusal, merge_usage_sse

RESPONSES, MESSAGES = dialect_for("/responses"), dialect_for("/messages")


def test_each_route_has_its_dialect_and_the_rest_passes_through() -> None:
    assert {d.kind for d in DIALECTS} == set(Kind)
    assert dialect_for("/chat/completions/").kind is Kind.CHAT  # type: ignore[union-attr]
    for path in ("/messages/count_tokens", "/responses/resp_1", "/embeddings", "/models"):
        assert dialect_for(path) is None


def test_responses_input_is_read_as_a_chat_conversation() -> None:
    assert RESPONSES is not None
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Weather?"},
            {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        ],
    }
    plan = RESPONSES.plan(json.dumps(body).encode(), None)
    assert plan.messages is not None
    assert [m["role"] for m in plan.messages] == ["system", "user", "assistant", "tool"]
    assert plan.ids_skipped is None and plan.affinity_key.startswith("chat:")
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}
    assert RESPONSES.plan(json.dumps({"input": [image]}).encode(), None).ids_skipped == "media"


@pytest.mark.parametrize("field", ["request_id", "previous_response_id"])
def test_a_responses_id_past_its_bound_is_refused_naming_it(field: str) -> None:
    """vLLM echoes these ids in its answer, where each is tagged (``_stored_state``)."""
    assert RESPONSES is not None
    from pdclient.dialects import MAX_ID_LENGTH

    fitting = {"model": "m", "input": "hi", field: "r" * MAX_ID_LENGTH}
    RESPONSES.plan(json.dumps(fitting).encode(), None)
    with pytest.raises(Refusal, match=rf"{field} .*longer than {MAX_ID_LENGTH}"):
        RESPONSES.plan(json.dumps({**fitting, field: "r" * 2_000_000}).encode(), None)


def test_previous_response_id_is_read_once_for_the_plan_its_state_and_its_tag(monkeypatch: pytest.MonkeyPatch) -> None:
    assert RESPONSES is not None
    from pdclient import wire
    from pdclient.dialects import endpoint_tag, tag_id

    tag = endpoint_tag("http://d1:8200/v1")
    body = {"model": "m", "input": "hi", "previous_response_id": tag_id("resp_1", tag)}
    reads: list[str] = []
    read = wire.field_value

    def counted(fields: wire.Fields, name: str) -> Any:
        reads.append(name)
        return read(fields, name)

    monkeypatch.setattr(wire, "field_value", counted)
    plan = RESPONSES.plan(json.dumps(body).encode(), None)
    assert RESPONSES.stored_state(plan) == "previous_response_id"
    assert RESPONSES.stored_at(plan) == tag
    assert json.loads(bytes(plan.fields["previous_response_id"])) == "resp_1"  # the server's own id
    assert reads.count("previous_response_id") == 1
    untagged = RESPONSES.plan(json.dumps({**body, "previous_response_id": "resp_2"}).encode(), None)
    assert RESPONSES.stored_state(untagged) == "previous_response_id" and RESPONSES.stored_at(untagged) is None
    other = RESPONSES.plan(json.dumps({"input": "hi", "conversation": "conv_1"}).encode(), None)
    assert RESPONSES.stored_state(other) == "conversation" and RESPONSES.stored_at(other) is None
    plain = RESPONSES.plan(b'{"input": "hi", "previous_response_id": 7}', None)
    assert RESPONSES.stored_state(plain) == "previous_response_id" and RESPONSES.stored_at(plain) is None


def test_messages_turns_are_read_as_a_chat_conversation() -> None:
    assert MESSAGES is not None
    body = {"system": "Be brief.", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}
    plan = MESSAGES.plan(json.dumps(body).encode(), None)
    assert plan.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    media = {"messages": [{"role": "user", "content": [image]}]}
    assert MESSAGES.plan(json.dumps(media).encode(), None).ids_skipped == "media"
    with pytest.raises(Refusal, match="messages"):
        MESSAGES.plan(b'{"messages": "hi"}', None)


def _answer(ids: Any, input_tokens: int = 3) -> bytes:
    kv = {"remote_engine_id": "e", "prompt_token_ids": ids}
    return json.dumps({"usage": {"input_tokens": input_tokens}, "kv_transfer_params": kv}).encode()


@pytest.mark.parametrize(
    ("ids", "problem"),
    [
        ([1, 2, 3], None),
        ([1, 2], "2 prompt_token_ids for a prompt of 3 tokens"),
        ([1, -2, 3], "not a non-empty list"),
        ([1, True, 3], "not a non-empty list"),
        ([], "not a non-empty list"),
        (None, "server patch"),
    ],
)
def test_the_prefills_ids_are_checked_and_cut_out_of_its_kv_params(ids: Any, problem: str | None) -> None:
    assert RESPONSES is not None
    result = RESPONSES.read_prefill(_answer(ids))
    assert json.loads(result.kv_transfer_params or b"null") == {"remote_engine_id": "e"}
    if problem is None:
        assert result.ids == b"[1,2,3]" and result.count == 3 and result.problem is None
    else:
        assert result.ids is None and result.problem is not None and problem in result.problem


def test_responses_usage_takes_the_input_side_from_the_prefill() -> None:
    assert RESPONSES is not None
    prefill = RESPONSES.read_prefill(
        json.dumps(
            {"usage": {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 2}, "output_tokens": 1}}
        ).encode()
    )
    merge = RESPONSES.usage_merge(prefill, "text/event-stream")
    assert merge is not None
    decode = {"input_tokens": 3, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 7, "total_tokens": 10}
    event = {"type": "response.completed", "response": {"usage": decode}}
    out = merge.feed(f"event: response.completed\ndata: {json.dumps(event)}\n\n".encode()) + merge.end()
    merged = json.loads(out.split(b"data: ")[1])["response"]["usage"]
    assert merged == {**decode, "input_tokens_details": {"cached_tokens": 2}, "total_tokens": 10}


def test_messages_usage_takes_the_input_side_from_the_prefill() -> None:
    assert MESSAGES is not None
    prefill = MESSAGES.read_prefill(json.dumps({"usage": {"input_tokens": 1, "cache_read_input_tokens": 2}}).encode())
    merge = MESSAGES.usage_merge(prefill, "application/json")
    assert merge is not None
    decode = {"input_tokens": 0, "cache_read_input_tokens": 3, "cache_creation_input_tokens": 0, "output_tokens": 5}
    out = merge.feed(json.dumps({"usage": decode}).encode()) + merge.end()
    assert json.loads(out)["usage"] == {"input_tokens": 1, "cache_read_input_tokens": 2, "output_tokens": 5}


def test_chats_usage_rule_is_unchanged() -> None:
    event = b'data: {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}}\n\n'
    merged = merge_usage_sse(event, {"prompt_tokens": 5})
    assert json.loads(merged[6:])["usage"] == {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
