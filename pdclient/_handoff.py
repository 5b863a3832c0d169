"""The P/D handoff as pure functions: no I/O, shared by the sync and async transports.

One call is planned in three steps, each a plain function of JSON-shaped data:

1. ``plan_prefill(kind, body)``: the prefill leg's body (non-streamed, one token,
   ``return_token_ids``, ``kv_transfer_params.do_remote_decode``);
2. ``read_prefill(kind, payload)``: the prefill's ``prompt_token_ids`` and
   ``kv_transfer_params``, validated;
3. ``plan_decode(kind, body, prefill)``: the caller's body plus the prefill's
   ``kv_transfer_params`` and the forwarded ids.

The wire contract is the one in DESIGN.md (measured on vLLM 0.32).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson

JSONDict = dict[str, Any]

# What the prefill leg asks of the KV connector: keep the blocks for a remote decode.
PREFILL_KV_TRANSFER_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

# Content part types vLLM renders as plain text; any other part is media that the
# decode server must render itself (its placeholder tokens depend on the processor).
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "reasoning"})


class Kind(enum.Enum):
    CHAT = "chat"
    COMPLETIONS = "completions"


def route_kind(relative_path: str) -> Kind | None:
    """Which handoff a request path takes, or None for a plain pass-through."""
    path = relative_path.rstrip("/")
    if path == "/chat/completions":
        return Kind.CHAT
    if path == "/completions":
        return Kind.COMPLETIONS
    return None


def handoff_refusal(kind: Kind, body: Mapping[str, Any]) -> str | None:
    """Why a request cannot be split into P/D legs at all, or None when it can.

    Raised as a 400 by the transport: these are caller errors that a silent pass-through
    would hide (two parties would then write ``kv_transfer_params``).
    """
    if "kv_transfer_params" in body:
        return "kv_transfer_params is written by pdclient; remove it from the request (extra_body)"
    if kind is Kind.COMPLETIONS:
        prompt = body.get("prompt")
        if not (isinstance(prompt, str) or _is_token_list(prompt) or _is_single_item_batch(prompt)):
            return "prompt: a P/D completions call takes one prompt (a string or a list of token ids), not a batch"
    return None


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(i) is int for i in value)


def _is_single_item_batch(value: object) -> bool:
    return isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or _is_token_list(value[0]))


def ids_not_forwarded_because(kind: Kind, body: Mapping[str, Any]) -> str | None:
    """Why the decode leg must render the prompt itself, or None when ids can be forwarded."""
    if body.get("echo"):
        return "echo"
    if kind is Kind.CHAT and _has_media(body.get("messages")):
        return "media"
    return None


def _has_media(messages: object) -> bool:
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and part.get("type") not in _TEXT_PART_TYPES:
                    return True
    return False


def _one_token(body: Mapping[str, Any]) -> JSONDict:
    """The body as a non-streamed call that samples a single token."""
    short = dict(body)
    # A streamed vLLM response never carries kv_transfer_params.
    short["stream"] = False
    short.pop("stream_options", None)
    short["max_tokens"] = 1
    if "max_completion_tokens" in short:
        short["max_completion_tokens"] = 1
    short.pop("min_tokens", None)
    short["n"] = 1
    short.pop("best_of", None)
    return short


def plan_prefill(kind: Kind, body: Mapping[str, Any]) -> JSONDict:
    """The prefill leg's body: the caller's body, made into a one-token non-streamed call.

    Everything that shapes the rendered prompt (messages, tools, tool_choice,
    chat_template_kwargs, response_format, ...) stays as the caller sent it, so the
    prefill renders exactly the prompt the decode would have rendered. One sample is all
    the prefill produces of value: the KV cache and the ids.
    """
    prefill = _one_token(body)
    prefill["return_token_ids"] = True
    prefill["kv_transfer_params"] = dict(PREFILL_KV_TRANSFER_PARAMS)
    if kind is Kind.COMPLETIONS and _is_single_item_batch(body.get("prompt")):
        prefill["prompt"] = body["prompt"][0]
    return prefill


@dataclass(frozen=True, slots=True)
class PrefillResult:
    """What the decode leg needs from the prefill response."""

    prompt_token_ids: list[int] | None
    kv_transfer_params: JSONDict | None
    problem: str | None = None
    """Why no ids were taken from the response, when ``prompt_token_ids`` is None."""


_ID_BYTES = b"0123456789,"


def _all_token_ids(ids: list[Any]) -> bool:
    """Every item a non-negative int (not a bool), checked on orjson's encoding of the list.

    At 32k ids this takes ~0.2 ms where a Python loop over the items takes ~1.3 ms: most
    of the handoff's CPU time. A bool, float, string, negative or nested item puts a byte
    other than digits and commas in the encoding.
    """
    try:
        encoded = orjson.dumps(ids)
    except orjson.JSONEncodeError:  # an int beyond 64 bits, or not JSON at all
        return False
    return not encoded[1:-1].translate(None, _ID_BYTES)


def read_prefill(kind: Kind, payload: object) -> PrefillResult:
    """Read the prefill's ids and KV transfer parameters, trusting nothing about its shape."""
    if not isinstance(payload, dict):
        return PrefillResult(None, None, "prefill response is not a JSON object")
    kv_params = payload.get("kv_transfer_params")
    if not isinstance(kv_params, dict):
        kv_params = None
    if kind is Kind.CHAT:
        ids = payload.get("prompt_token_ids")
    else:
        choices = payload.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        ids = first.get("prompt_token_ids") if isinstance(first, dict) else None
    if ids is None:
        return PrefillResult(None, kv_params, "prefill response has no prompt_token_ids")
    if not isinstance(ids, list) or not ids or not _all_token_ids(ids):
        return PrefillResult(None, kv_params, "prefill prompt_token_ids is not a non-empty list of token ids")
    return PrefillResult(ids, kv_params)


def plan_decode(kind: Kind, body: Mapping[str, Any], prefill: PrefillResult | None, *, forward_ids: bool) -> JSONDict:
    """The decode leg's body: the caller's body with the prefill's handoff attached.

    The prefill's ``kv_transfer_params`` go through whole and unmodified (they belong
    to its KV connector). The ids are never extended by the prefill's sampled token:
    the decode prompt must have the prefill's length for the connector's block
    accounting.
    """
    decode = dict(body)
    if prefill is None:
        return decode
    ids = prefill.prompt_token_ids if forward_ids else None
    kv_params = dict(prefill.kv_transfer_params or {})
    if ids is not None and kind is Kind.CHAT:
        kv_params["prompt_token_ids"] = ids
    elif ids is not None:
        # vLLM takes a token-id prompt on /completions natively, in every version.
        decode["prompt"] = ids
    if kv_params:
        decode["kv_transfer_params"] = kv_params
    return decode


def plan_release(kind: Kind, body: Mapping[str, Any], prefill: PrefillResult, *, forward_ids: bool) -> JSONDict:
    """A one-token decode that completes an abandoned handoff.

    The prefill server keeps a request's KV blocks until a decode pulls them (or until
    the connector's timeout, minutes later). When the caller goes away between the two
    legs, this minimal decode pulls them so the prefill server frees them at once.
    """
    return _one_token(plan_decode(kind, body, prefill, forward_ids=forward_ids))


def holds_remote_kv(prefill: PrefillResult | None) -> bool:
    """Whether the prefill server is holding KV blocks for a decode that must follow."""
    return prefill is not None and bool(prefill.kv_transfer_params)


CALL_OPTIONS_KEY = "pdclient"
"""Per-call options travel in ``extra_body={"pdclient": {...}}`` and never reach a server."""


def take_call_options(body: JSONDict) -> JSONDict:
    """Remove and return the per-call options from a parsed request body."""
    options = body.pop(CALL_OPTIONS_KEY, None)
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"{CALL_OPTIONS_KEY} must be an object of per-call options, got {type(options).__name__}")
    return options


def affinity_key(kind: Kind, body: Mapping[str, Any], session: object) -> str:
    """The key that keeps one conversation on the same servers.

    An explicit session key wins. Otherwise a chat call's key is its conversation's
    opening, every message up to and including the first user message: it stays the same
    as the conversation grows, which is what a prefix cache rewards.
    """
    if session is not None:
        return f"session:{session}"
    if kind is Kind.CHAT and isinstance(body.get("messages"), list):
        opening: list[Any] = []
        for message in body["messages"]:
            opening.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        return "chat:" + _stable_json(opening)
    return "prompt:" + _stable_json(body.get("prompt"))[:4096]


def _stable_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)
