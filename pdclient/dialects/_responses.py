"""The Responses API (``/v1/responses``) as a P/D handoff.

- prefill leg: the caller's body with ``stream: false``, ``max_output_tokens: 1``,
  ``store: false`` (the prefill server keeps nothing), no ``background``, and the KV
  parameters asking for the prompt's ids (``_rendered``);
- decode leg: the caller's body plus the prefill's ``kv_transfer_params`` and the ids;
- usage: ``input_tokens`` and ``input_tokens_details`` (cached tokens) from the prefill,
  ``output_tokens`` from the decode, ``total_tokens`` recomputed; streamed, in the
  ``response.completed`` (or ``incomplete`` / ``failed``) event's ``response.usage``;
- a broken decode stream never moves: its events carry no token ids to continue from;
- a call building on stored state (``previous_response_id``, ``conversation``) runs
  decode-only: the server that answered before holds that state, the prefill server never
  does. Without a store the caller gets the decode server's own 404. Its answers' ids carry
  their decode endpoint's tag, and a ``previous_response_id`` carrying one is pinned there
  (``_stored_state``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import msgspec
import orjson

from .. import wire
from . import _rendered as rendered
from . import _stored_state as stored
from ._dialect import Dialect, merge_for

_ROLES = frozenset({"system", "developer", "user", "assistant"})
_INPUT_SIDE = ("input_tokens", "input_tokens_details")
_STORED_STATE = ("previous_response_id", "conversation")
"""State the decode server stored (``VLLM_ENABLE_RESPONSES_API_STORE=1``) that a call builds on."""


def conversation(fields: wire.Fields) -> list[Any] | None:
    """The call's input items as chat messages: what ``auto`` and the affinity key read."""
    messages: list[Any] = []
    instructions = rendered.value(fields, "instructions")
    if isinstance(instructions, str):
        messages.append({"role": "system", "content": instructions})
    items = rendered.value(fields, "input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list):
        return messages
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") in _ROLES:
            messages.append({"role": item["role"], "content": item.get("content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function"}
            call["function"] = {"name": item.get("name"), "arguments": item.get("arguments")}
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        else:  # reasoning, a built-in tool's items: the server renders them; they count as text here
            messages.append({"role": "assistant", "content": [{"type": "text", "text": str(item)}]})
    return messages


def _prompt_count(use: Mapping[str, Any]) -> int | None:
    count = use.get("input_tokens")
    return count if rendered.is_count(count) else None


def _input_side(use: Mapping[str, Any]) -> dict[str, Any] | None:
    if not rendered.is_count(use.get("input_tokens")):
        return None
    return {k: use[k] for k in _INPUT_SIDE if k in use}


def merge_payload(payload: dict[str, Any], prefill: Mapping[str, Any], streamed: bool) -> bool:
    """A Responses body's ``usage``, or a streamed event's ``response.usage``, merged in place."""
    target = payload.get("response") if streamed else payload
    if not isinstance(target, dict) or not isinstance(target.get("usage"), dict):
        return False
    merged = rendered.merged_usage(target["usage"], prefill, _INPUT_SIDE, "total_tokens")
    if merged == target["usage"]:
        return False
    target["usage"] = merged
    return True


def _check_echoed(name: str, own: str) -> None:
    """An id vLLM echoes in its answer (``request_id``, ``previous_response_id``), within its bound."""
    if len(own) > stored.MAX_ID_LENGTH:
        raise wire.Refusal(
            f"{name} is {len(own)} characters, longer than {stored.MAX_ID_LENGTH} (pdclient's bound on the "
            "ids vLLM echoes in its answer)"
        )


def _one_output_token(fields: wire.Fields) -> wire.Fields:
    short = dict(fields)
    short["stream"] = rendered.FALSE
    short["max_output_tokens"] = rendered.ONE
    short["store"] = rendered.FALSE
    short.pop("background", None)
    short.pop("stream_options", None)
    return short


class Responses(Dialect):
    kind = wire.Kind.RESPONSES
    path = "/responses"
    migration_refusal: str | None = "the Responses API (its events carry no token ids to continue from)"

    def plan(self, content: bytes, tenant: str | None) -> wire.Plan:
        plan = rendered.plan_with_conversation(self.kind, content, tenant, conversation)
        stored_state = tag = None
        for name in _STORED_STATE:  # read now: one pdclient cannot read is a 400 before any leg
            given = rendered.value(plan.fields, name)
            if given is None:
                continue
            stored_state = stored_state or name
            if name == "previous_response_id" and isinstance(given, str):
                own, tag = stored.untag_id(given)
                _check_echoed(name, own)
                if tag is not None:  # the server gets its own id
                    plan.fields[name] = msgspec.Raw(orjson.dumps(own))
        request_id = rendered.value(plan.fields, "request_id")
        if isinstance(request_id, str):
            _check_echoed("request_id", stored.untag_id(request_id)[0])
        return dataclasses.replace(plan, stored_state=stored_state, stored_tag=tag)

    def stored_state(self, plan: wire.Plan) -> str | None:
        return plan.stored_state

    tags_answer_ids = True

    def stored_at(self, plan: wire.Plan) -> str | None:
        return plan.stored_tag

    def prefill_body(self, plan: wire.Plan) -> bytes:
        fields = _one_output_token(plan.fields)
        fields["kv_transfer_params"] = rendered.prefill_kv(plan)
        return wire.encode_fields(fields)

    def warm_up_body(self, plan: wire.Plan) -> bytes:
        return wire.encode_fields(_one_output_token(plan.fields))

    def read_prefill(self, content: bytes) -> wire.PrefillResult:
        return rendered.read_kv_ids(content, _prompt_count, _input_side)

    def decode_body(self, plan: wire.Plan, prefill: wire.PrefillResult | None) -> bytes:
        return wire.encode_fields(rendered.decode_fields(plan, prefill))

    def release_body(self, plan: wire.Plan, prefill: wire.PrefillResult) -> bytes:
        return wire.encode_fields(_one_output_token(rendered.decode_fields(plan, prefill)))

    def usage_merge(self, prefill: wire.PrefillResult, content_type: str) -> wire.UsageMerge | None:
        return merge_for(rendered.input_side_of(prefill), content_type, merge_payload)


RESPONSES = Responses()
