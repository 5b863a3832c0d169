"""The prefill leg: its bodies (the handoff's, a warm-up, a continuation's on ids) and its
answer, whose prompt ids are located and checked on the bytes, never decoded into ints."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from ._plan import Fields, Kind, Plan, encode_fields

# What the prefill leg asks of the KV connector: keep the blocks for a remote decode.
PREFILL_KV_TRANSFER_PARAMS: Mapping[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
_PREFILL_KV_RAW = msgspec.Raw(orjson.dumps(PREFILL_KV_TRANSFER_PARAMS))
_TRUE, _FALSE, _ONE = msgspec.Raw(b"true"), msgspec.Raw(b"false"), msgspec.Raw(b"1")


def one_token(fields: Fields) -> dict[str, msgspec.Raw]:
    """The fields of a non-streamed call that samples a single token."""
    short = dict(fields)
    # A streamed vLLM response never carries kv_transfer_params.
    short["stream"] = _FALSE
    short.pop("stream_options", None)
    short["max_tokens"] = _ONE
    if "max_completion_tokens" in short:
        short["max_completion_tokens"] = _ONE
    short.pop("min_tokens", None)
    short["n"] = _ONE
    short.pop("best_of", None)
    return short


def prefill_body(plan: Plan) -> bytes:
    """The prefill leg: the caller's call made into a one-token non-streamed call.

    Everything that shapes the rendered prompt (messages, tools, tool_choice,
    chat_template_kwargs, response_format, ...) stays as the caller sent it, so the
    prefill renders exactly the prompt the decode would have rendered.
    """
    fields = one_token(plan.fields)
    fields["return_token_ids"] = _TRUE
    fields["kv_transfer_params"] = _PREFILL_KV_RAW
    return encode_fields(fields)


def warm_up_body(plan: Plan) -> bytes:
    """A prefill warm-up (``fleet._warm``): the caller's call as a one-token call, and nothing more.

    No ``kv_transfer_params``: the server caches the prompt's blocks as for any call and
    holds nothing for a decode that will not come.
    """
    return encode_fields(one_token(plan.fields))


def prefill_body_for_ids(plan: Plan, ids: bytes) -> bytes:
    """A prefill leg whose prompt is given as token ids (a JSON array), not rendered.

    Chat: the ids ride in ``kv_transfer_params.prompt_token_ids`` next to
    ``do_remote_decode`` (vLLM 0.27+ honours them on this leg too); completions: the
    ``prompt`` is the ids. Used by a migrated decode (pdclient/migration/_continuation.py).
    """
    fields = one_token(plan.fields)
    fields["return_token_ids"] = _TRUE
    if plan.kind is Kind.CHAT:
        fields["kv_transfer_params"] = msgspec.Raw(with_prompt_ids(bytes(_PREFILL_KV_RAW), ids))
    else:
        fields["prompt"] = msgspec.Raw(ids)
        fields["kv_transfer_params"] = _PREFILL_KV_RAW
    return encode_fields(fields)


@dataclass(frozen=True)
class PrefillResult:
    """What the decode leg needs from the prefill response, as bytes."""

    ids: bytes | None
    """The JSON array of prompt token ids, exactly as the prefill sent it."""
    count: int
    kv_transfer_params: bytes | None
    """The prefill's ``kv_transfer_params`` JSON object, or None when it sent none."""
    problem: str | None = None
    """Why no ids were taken from the response, when ``ids`` is None."""
    prompt_tokens_details: bytes | None = None
    """The prefill's ``usage.prompt_tokens_details`` JSON object (its cached tokens), when it sent one."""
    usage: bytes | None = None
    """The input side of the prefill's ``usage`` as a JSON object, for a dialect whose usage is
    not chat's (``pdclient.dialects``); chat and completions keep ``prompt_tokens_details``."""

    @property
    def holds_remote_kv(self) -> bool:
        """Whether the prefill server is holding KV blocks for a decode that must follow."""
        return self.kv_transfer_params is not None and self.kv_transfer_params.strip() != b"{}"


class _Usage(msgspec.Struct):
    prompt_tokens: int | None = None
    prompt_tokens_details: msgspec.Raw = msgspec.Raw(b"null")


class _ChatIds(msgspec.Struct):
    prompt_token_ids: msgspec.Raw = msgspec.Raw(b"null")
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")
    usage: _Usage | None = None


class _Choice(msgspec.Struct):
    prompt_token_ids: msgspec.Raw = msgspec.Raw(b"null")


class _CompletionIds(msgspec.Struct):
    choices: list[_Choice] = []
    kv_transfer_params: msgspec.Raw = msgspec.Raw(b"null")
    usage: _Usage | None = None


_DECODERS: dict[Kind, msgspec.json.Decoder[Any]] = {
    Kind.CHAT: msgspec.json.Decoder(_ChatIds),
    Kind.COMPLETIONS: msgspec.json.Decoder(_CompletionIds),
}
_IDS_KEY = b'"prompt_token_ids":'
_PLACEHOLDER = b"0"
_DIGITS = b"0123456789"


def read_prefill(kind: Kind, content: bytes) -> PrefillResult:
    """The prefill's ids and KV transfer parameters, trusting nothing about its shape."""
    # vLLM writes the ids' key before the ids, and nothing before them holds such a key: the
    # first one is found without a scan over the ids; the last one if the first is not the field.
    first = content.find(_IDS_KEY)
    compact = _read_compact(kind, content, first)
    if compact is None and first >= 0 and (last := content.rfind(_IDS_KEY)) != first:
        compact = _read_compact(kind, content, last)
    return compact if compact is not None else _read_parsed(kind, content)


def _read_compact(kind: Kind, content: bytes, at: int) -> PrefillResult | None:
    """The fast path, for the compact JSON vLLM writes; None when it cannot vouch for the result.

    The id array (the value of the key at ``at``) is cut out of the body and the rest (a few
    KB) is decoded, which checks that the array cut out is the very field the contract names.
    The array itself is checked on its bytes: digits and commas only, and as many ids as the
    prefill's own ``usage.prompt_tokens`` (which also rules out an empty item). No id becomes
    a Python object.
    """
    start = at + len(_IDS_KEY)
    end = content.find(b"]", start)
    if at < 0 or content[start : start + 1] != b"[" or end < 0:
        return None
    ids = content[start : end + 1]
    try:
        decoded = _DECODERS[kind].decode(content[:start] + _PLACEHOLDER + content[end + 1 :])
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    if isinstance(decoded, _ChatIds):
        field = decoded.prompt_token_ids
    else:
        field = decoded.choices[0].prompt_token_ids if decoded.choices else msgspec.Raw(b"null")
    if bytes(field) != _PLACEHOLDER:
        return None
    count = _count_token_ids(ids, decoded.usage.prompt_tokens if decoded.usage else None)
    if count == 0:
        return None
    details = _json_object(bytes(decoded.usage.prompt_tokens_details)) if decoded.usage else None
    return PrefillResult(ids, count, _json_object(bytes(decoded.kv_transfer_params)), None, details)


def _json_object(raw: bytes) -> bytes | None:
    raw = raw.strip()
    return raw if raw.startswith(b"{") else None


def _read_parsed(kind: Kind, content: bytes) -> PrefillResult:
    """The exact path for any other shape: parse the whole response."""
    try:
        payload = orjson.loads(content)
    except orjson.JSONDecodeError:
        return PrefillResult(None, 0, None, "prefill response is not a JSON object")
    if not isinstance(payload, dict):
        return PrefillResult(None, 0, None, "prefill response is not a JSON object")
    kv = payload.get("kv_transfer_params")
    kv_params = orjson.dumps(kv) if isinstance(kv, dict) else None
    if kind is Kind.CHAT:
        ids = payload.get("prompt_token_ids")
    else:
        choices = payload.get("choices")
        first = choices[0] if isinstance(choices, list) and choices else None
        ids = first.get("prompt_token_ids") if isinstance(first, dict) else None
    if ids is None:
        return PrefillResult(None, 0, kv_params, "prefill response has no prompt_token_ids")
    if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
        return PrefillResult(None, 0, kv_params, "prefill prompt_token_ids is not a non-empty list of token ids")
    usage = payload.get("usage")
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    details_raw = orjson.dumps(details) if isinstance(details, dict) else None
    return PrefillResult(orjson.dumps(ids), len(ids), kv_params, None, details_raw)


def _count_token_ids(array: bytes, expected: int | None) -> int:
    """How many ids a JSON array of non-negative integers holds; 0 if it is anything else.

    A float, sign, string, bool, null, nested array or whitespace leaves a byte that is
    neither a digit nor a comma. An empty item (``1,,2``) shows as one comma too many
    against the server's own count, or, without one, is looked for. vLLM writes ids
    compactly; anything else goes to the exact, parsing path.
    """
    if len(array) < 3 or array[1:2] == b"," or array[-2:-1] == b",":
        return 0  # empty, or an empty first or last item
    # One pass over the array's bytes (its brackets kept: no copy of the ids); what is left is
    # compared with what it must be, in place of a second pass to find any other byte.
    kept = array.translate(None, _DIGITS)
    if kept != b"[" + b"," * (len(kept) - 2) + b"]":
        return 0
    count = len(kept) - 1
    if expected is None:
        return 0 if b",," in array else count
    return count if count == expected else 0


def with_prompt_ids(kv_params: bytes | None, ids: bytes) -> bytes:
    """The prefill's ``kv_transfer_params`` object with ``"prompt_token_ids": ids`` appended."""
    if kv_params is None or kv_params.strip() == b"{}":
        return b'{"prompt_token_ids":' + ids + b"}"
    return b"".join((kv_params.rstrip()[:-1], b',"prompt_token_ids":', ids, b"}"))  # the ids copied once
