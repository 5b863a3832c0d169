"""The caller's body, read once: its top-level fields as the exact bytes sent (``Fields``),
the API it speaks (``Kind``), the ``Plan`` of its handoff and its affinity key, and the
per-call options taken out of it."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from .._errors import PDConfigError
from ._call_options import CALL_OPTIONS_KEY, CallOptions, parse_call_options
from ._forwarded import KV_TRANSFER_PARAMS, Refusal, kv_params_in_json, kv_refusal
from ._parts import has_media

Fields = dict[str, msgspec.Raw]
_fields_decoder = msgspec.json.Decoder(Fields)
_encoder = msgspec.json.Encoder()


class Kind(enum.Enum):
    """The API a P/D call speaks; each has its dialect (``pdclient.dialects``)."""

    CHAT = "chat"
    COMPLETIONS = "completions"
    RESPONSES = "responses"
    MESSAGES = "messages"


def route_kind(relative_path: str) -> Kind | None:
    """Which handoff a request path takes, or None for a plain pass-through."""
    path = relative_path.rstrip("/")
    if path == "/chat/completions":
        return Kind.CHAT
    if path == "/completions":
        return Kind.COMPLETIONS
    return None


def read_fields(content: bytes) -> Fields:
    """The top-level fields of a JSON object body, each as its raw bytes."""
    try:
        return _fields_decoder.decode(content)
    except msgspec.DecodeError as exc:
        raise Refusal(f"request body is not a JSON object: {exc}") from None


def encode_fields(fields: Mapping[str, msgspec.Raw | Any]) -> bytes:
    return _encoder.encode(fields)


MAX_NESTING = 254
"""The deepest JSON pdclient writes back (orjson's limit): a field it reads (and so may
encode again, in a key, a digest, a leg's body) nested deeper is refused."""


def field_value(fields: Fields, name: str) -> Any:
    """A field of the caller's body as JSON, None when absent: the one way pdclient reads one.

    ``Refusal`` naming the field when pdclient cannot read it (a number beyond a double's
    range, ``1e999``, which vLLM's Python reads as infinity) or write it back (nested deeper
    than ``MAX_NESTING``, which vLLM reads up to Python's recursion limit).
    """
    raw = fields.get(name)
    if raw is None:
        return None
    try:
        value = orjson.loads(memoryview(raw))
    except orjson.JSONDecodeError as exc:
        raise Refusal(f"{name}: not JSON pdclient can read ({exc})") from None
    if isinstance(value, (list, dict)) and len(raw) > 2 * MAX_NESTING:  # shallower ones are too short to nest deeper
        try:
            orjson.dumps(value)
        except orjson.JSONEncodeError:
            raise Refusal(
                f"{name}: JSON nested deeper than {MAX_NESTING} levels, the most pdclient encodes again"
            ) from None
    return value


@dataclass(frozen=True)
class Plan:
    """One chat or completions call, read once from the caller's body."""

    kind: Kind
    fields: Fields
    """The caller's top-level fields without ``pdclient``, as sent."""
    options: CallOptions
    stream: bool
    messages: list[Any] | None
    """Chat only: the parsed messages (read by the affinity key and the media check)."""
    ids_skipped: str | None
    """Why the decode must render the prompt itself (``media``, ``echo``, ``forward_ids off``)."""
    affinity_key: str
    """The conversation's key, within its tenant's (``affinity_key``)."""
    tenant: str | None = None
    """Who is calling (``RouteRequest.tenant``), when a server that passes many callers' requests on says."""
    stored_state: str | None = None
    """The field naming state a server stored that the call builds on (a dialect's ``stored_state``)."""
    stored_tag: str | None = None
    """The decode endpoint's tag that field's id carried, taken off it (a dialect's ``stored_at``)."""


def plan_call(kind: Kind, content: bytes, tenant: str | None = None) -> Plan:
    """Read the caller's body; raises ``Refusal`` for a request that cannot be split."""
    fields = read_fields(content)
    options = _take_call_options(fields)
    if KV_TRANSFER_PARAMS in fields:  # its name unescaped, duplicates seen
        raise Refusal(kv_refusal(""))
    nested = kv_params_in_json(content)  # e.g. in vllm_xargs, which vLLM hands to the connector too
    if nested is not None:
        raise Refusal(kv_refusal(f"at {nested}"))
    messages = field_value(fields, "messages") if kind is Kind.CHAT else None
    prompt = field_value(fields, "prompt") if kind is Kind.COMPLETIONS else None
    stream = bool(field_value(fields, "stream"))
    echo = bool(field_value(fields, "echo"))
    if kind is Kind.CHAT and not isinstance(messages, list):
        raise Refusal("messages: a chat call needs a list of messages")
    if kind is Kind.COMPLETIONS:
        if _is_single_item_batch(prompt):
            fields["prompt"] = msgspec.Raw(orjson.dumps(prompt[0]))  # type: ignore[index]
        elif not (isinstance(prompt, str) or _is_token_list(prompt)):
            raise Refusal(
                "prompt: a P/D completions call takes one prompt (a string or a list of token ids), not a batch"
            )
    if echo:
        ids_skipped: str | None = "echo"
    elif kind is Kind.CHAT and has_media(messages):
        ids_skipped = "media"
    elif not options.forward_ids:
        ids_skipped = "forward_ids off"
    else:
        ids_skipped = None
    return Plan(
        kind=kind,
        fields=fields,
        options=options,
        stream=stream,
        messages=messages,
        ids_skipped=ids_skipped,
        affinity_key=affinity_key(kind, messages, prompt, options.session, tenant),
        tenant=tenant,
    )


def _is_token_list(value: object) -> bool:
    return isinstance(value, list) and bool(value) and all(type(i) is int for i in value)


def _is_single_item_batch(value: object) -> bool:
    return isinstance(value, list) and len(value) == 1 and (isinstance(value[0], str) or _is_token_list(value[0]))


def affinity_key(
    kind: Kind, messages: list[Any] | None, prompt: object, session: str | None, tenant: str | None = None
) -> str:
    """The key that keeps one conversation on the same servers.

    An explicit session key wins. Otherwise a chat call's key is its conversation's
    opening, every message up to and including the first user message: it stays the same
    as the conversation grows, which is what a prefix cache rewards.

    A tenant's keys are its own: two callers of a proxy with the same opening (or the same
    session) are two conversations, so neither learns of nor evicts the other's.
    """
    if session is not None:
        key = f"session:{session}"
    elif kind is Kind.CHAT and messages is not None:
        opening: list[Any] = []
        for message in messages:
            opening.append(message)
            if isinstance(message, dict) and message.get("role") == "user":
                break
        key = "chat:" + _stable_json(opening)
    else:
        key = "prompt:" + _stable_json(prompt)[:4096]
    # The tenant's length first: no tenant's keys can spell another's.
    return key if tenant is None else f"tenant:{len(tenant)}:{tenant}|{key}"


def _stable_json(value: object) -> str:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_PASSTHROUGH_SUBCLASS, default=str).decode()


def without_call_options(content: bytes) -> bytes:
    """A pass-through JSON body without the ``pdclient`` per-call options, the rest as sent.

    Raises ``Refusal`` when they are misspelt or of the wrong type, as on a P/D call.
    """
    if CALL_OPTIONS_KEY.encode() not in content:
        return content
    try:
        fields = _fields_decoder.decode(content)
    except msgspec.DecodeError:
        return content  # not a JSON object: the server answers for it
    if CALL_OPTIONS_KEY not in fields:
        return content
    _take_call_options(fields)
    return encode_fields(fields)


def _take_call_options(fields: Fields) -> CallOptions:
    given = field_value(fields, CALL_OPTIONS_KEY)
    fields.pop(CALL_OPTIONS_KEY, None)
    try:
        return parse_call_options(given)
    except PDConfigError as exc:
        raise Refusal(str(exc)) from None
