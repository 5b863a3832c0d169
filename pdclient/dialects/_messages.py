"""The Anthropic Messages API (``/v1/messages``) as a P/D handoff.

vLLM turns a Messages request into a chat request before it renders it, so the handoff is
chat's in Messages clothes:

- prefill leg: the caller's body with ``stream: false``, ``max_tokens: 1`` and the KV
  parameters asking for the prompt's ids (``_rendered``); vLLM skips its thinking-budget
  check on such a leg;
- decode leg: the caller's body plus the prefill's ``kv_transfer_params`` and the ids;
- usage: ``input_tokens``, ``cache_read_input_tokens`` and ``cache_creation_input_tokens``
  from the prefill (vLLM's ``input_tokens`` leaves the cached ones out), ``output_tokens``
  from the decode; streamed, in ``message_start``'s ``message.usage`` and
  ``message_delta``'s ``usage``;
- a broken decode stream never moves: its events carry no token ids to continue from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import orjson

from .. import wire
from . import _rendered as rendered
from ._dialect import Dialect, merge_for

_INPUT_SIDE = ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens")
_MEDIA_BLOCKS = frozenset({"image", "document"})


def _part(block: object) -> Any:
    if not isinstance(block, dict):
        return block
    kind = block.get("type")
    if kind in ("text", "thinking") or kind in _MEDIA_BLOCKS:
        return block  # text stays text; an image or document is media (``wire.has_media``)
    if kind == "tool_result":
        inner = block.get("content")
        if isinstance(inner, list):
            return {"type": "text", "text": orjson.dumps([_part(b) for b in inner]).decode()}
        return {"type": "text", "text": str(inner)}
    # tool_use, redacted thinking, ...: rendered as text by the server's chat template
    return {"type": "text", "text": orjson.dumps(block, default=str).decode()}


def conversation(fields: wire.Fields) -> list[Any] | None:
    """The call's system prompt and turns as chat messages: what ``auto`` and the affinity key read."""
    messages: list[Any] = []
    system = rendered.value(fields, "system")
    if isinstance(system, str | list):
        messages.append({"role": "system", "content": system if isinstance(system, str) else list(map(_part, system))})
    turns = rendered.value(fields, "messages")
    if not isinstance(turns, list):
        raise wire.Refusal("messages: a Messages call needs a list of messages")
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        content = turn.get("content")
        messages.append(
            {"role": turn.get("role"), "content": list(map(_part, content)) if isinstance(content, list) else content}
        )
    return messages


def _prompt_count(use: Mapping[str, Any]) -> int | None:
    counts = [use[k] for k in _INPUT_SIDE if use.get(k) is not None]
    if not counts or not all(rendered.is_count(c) for c in counts):
        return None
    return sum(int(c) for c in counts)


def _input_side(use: Mapping[str, Any]) -> dict[str, Any] | None:
    if not rendered.is_count(use.get("input_tokens")):
        return None
    return {k: use[k] for k in _INPUT_SIDE if k in use}


def merge_payload(payload: dict[str, Any], prefill: Mapping[str, Any], streamed: bool) -> bool:
    """A Messages body's ``usage``, or a streamed ``message_start`` / ``message_delta``'s, merged in place."""
    target: Any = payload
    if streamed and payload.get("type") == "message_start":
        target = payload.get("message")
    elif streamed and payload.get("type") != "message_delta":
        return False
    if not isinstance(target, dict) or not isinstance(target.get("usage"), dict):
        return False
    merged = rendered.merged_usage(target["usage"], prefill, _INPUT_SIDE, None)
    if merged == target["usage"]:
        return False
    target["usage"] = merged
    return True


def _one_token(fields: wire.Fields) -> wire.Fields:
    short = dict(fields)
    short["stream"] = rendered.FALSE
    short["max_tokens"] = rendered.ONE
    return short


class Messages(Dialect):
    kind = wire.Kind.MESSAGES
    path = "/messages"
    migration_refusal: str | None = "the Messages API (its events carry no token ids to continue from)"

    def plan(self, content: bytes, tenant: str | None) -> wire.Plan:
        return rendered.plan_with_conversation(self.kind, content, tenant, conversation)

    def prefill_body(self, plan: wire.Plan) -> bytes:
        fields = _one_token(plan.fields)
        fields["kv_transfer_params"] = rendered.prefill_kv(plan)
        return wire.encode_fields(fields)

    def warm_up_body(self, plan: wire.Plan) -> bytes:
        return wire.encode_fields(_one_token(plan.fields))

    def read_prefill(self, content: bytes) -> wire.PrefillResult:
        return rendered.read_kv_ids(content, _prompt_count, _input_side)

    def decode_body(self, plan: wire.Plan, prefill: wire.PrefillResult | None) -> bytes:
        return wire.encode_fields(rendered.decode_fields(plan, prefill))

    def release_body(self, plan: wire.Plan, prefill: wire.PrefillResult) -> bytes:
        return wire.encode_fields(_one_token(rendered.decode_fields(plan, prefill)))

    def usage_merge(self, prefill: wire.PrefillResult, content_type: str) -> wire.UsageMerge | None:
        return merge_for(rendered.input_side_of(prefill), content_type, merge_payload)


MESSAGES = Messages()
