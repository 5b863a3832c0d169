"""What the APIs vLLM renders through chat's ``preprocess_chat`` share: Responses and Messages.

Their prefill answers carry no prompt ids of their own. The prefill leg asks for them in
its ``kv_transfer_params`` (``return_prompt_token_ids``), and a server with pdclient's
server patch returns them there, as ``kv_transfer_params.prompt_token_ids``; vLLM 0.27+
honours the same key on the decode leg natively. Without the patch the answer has no ids
and the call is a KV handoff whose decode renders the prompt itself (``ids_skipped``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import msgspec
import orjson

from .. import wire
from ..wire import has_media

RETURN_IDS = "return_prompt_token_ids"
_PREFILL_KV = msgspec.Raw(orjson.dumps(dict(wire.PREFILL_KV_TRANSFER_PARAMS)))
_PREFILL_KV_WITH_IDS = msgspec.Raw(orjson.dumps({**wire.PREFILL_KV_TRANSFER_PARAMS, RETURN_IDS: True}))
FALSE, ONE = msgspec.Raw(b"false"), msgspec.Raw(b"1")
NO_IDS = "prefill answer has no prompt_token_ids in its kv_transfer_params (a server without pdclient's server patch)"


def plan_with_conversation(
    kind: wire.Kind, content: bytes, tenant: str | None, conversation: Callable[[wire.Fields], list[Any] | None]
) -> wire.Plan:
    """The generic plan (options taken, ``kv_transfer_params`` refused), with the call's
    conversation as chat messages: the affinity key, the media check and ``auto`` read it."""
    plan = wire.plan_call(kind, content, tenant)
    messages = conversation(plan.fields)
    ids_skipped = "media" if has_media(messages) else plan.ids_skipped
    key = wire.affinity_key(wire.Kind.CHAT, messages, None, plan.options.session, tenant)
    return replace(plan, messages=messages, ids_skipped=ids_skipped, affinity_key=key)


def value(fields: wire.Fields, name: str) -> Any:
    """A field as JSON (``wire.field_value``: a ``Refusal`` naming one pdclient cannot read)."""
    return wire.field_value(fields, name)


def prefill_kv(plan: wire.Plan) -> msgspec.Raw:
    """The prefill's KV parameters, asking for the prompt's ids when they will be forwarded."""
    return _PREFILL_KV if plan.ids_skipped is not None else _PREFILL_KV_WITH_IDS


def read_kv_ids(
    content: bytes,
    prompt_count: Callable[[Mapping[str, Any]], int | None],
    input_side: Callable[[Mapping[str, Any]], dict[str, Any] | None],
) -> wire.PrefillResult:
    """The ids in the answer's ``kv_transfer_params`` (cut out of the KV parameters the decode
    gets), checked as chat's are: a non-empty list of non-negative ints, as many as the
    prefill's own usage counts (``prompt_count``); and the input side of its usage."""
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        payload = None
    if not isinstance(payload, dict):
        return wire.PrefillResult(None, 0, None, "prefill response is not a JSON object")
    found = payload.get("usage")
    usage: dict[str, Any] = found if isinstance(found, dict) else {}
    side = input_side(usage)
    side_raw = orjson.dumps(side) if side is not None else None
    kv = payload.get("kv_transfer_params")
    if not isinstance(kv, dict):
        return wire.PrefillResult(None, 0, None, NO_IDS, usage=side_raw)
    ids = kv.pop("prompt_token_ids", None)
    kv_raw = orjson.dumps(kv)
    if ids is None:
        return wire.PrefillResult(None, 0, kv_raw, NO_IDS, usage=side_raw)
    if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
        problem = "prefill prompt_token_ids is not a non-empty list of token ids"
        return wire.PrefillResult(None, 0, kv_raw, problem, usage=side_raw)
    expected = prompt_count(usage)
    if expected is not None and expected != len(ids):
        problem = f"prefill sent {len(ids)} prompt_token_ids for a prompt of {expected} tokens"
        return wire.PrefillResult(None, 0, kv_raw, problem, usage=side_raw)
    return wire.PrefillResult(orjson.dumps(ids), len(ids), kv_raw, None, usage=side_raw)


def is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def decode_fields(plan: wire.Plan, prefill: wire.PrefillResult | None) -> wire.Fields:
    """The caller's fields plus the prefill's KV parameters and the ids (``wire.decode_fields``)."""
    return wire.decode_fields(plan, prefill)


def input_side_of(prefill: wire.PrefillResult) -> dict[str, Any] | None:
    return None if prefill.usage is None else orjson.loads(prefill.usage)


def merged_usage(
    decode: Mapping[str, Any], prefill: Mapping[str, Any], kept: tuple[str, ...], total: str | None
) -> dict[str, Any]:
    """The decode's usage with the ``kept`` input-side keys taken from the prefill (those the
    prefill did not report dropped: the decode's would count the pulled KV as cached) and
    ``total`` recomputed when the usage has one."""
    merged = dict(decode)
    for key in kept:
        if key in prefill:
            merged[key] = prefill[key]
        else:
            merged.pop(key, None)
    if total is not None and total in merged:
        counts = [merged.get("input_tokens"), merged.get("output_tokens")]
        if all(is_count(c) for c in counts):
            merged[total] = sum(c for c in counts if is_count(c))
    return merged
