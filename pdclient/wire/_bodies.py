"""The wire contract of a P/D call, on bytes: pure functions, no I/O.

The caller's JSON body is read once into its top-level fields, each kept as the exact
bytes the caller sent (``msgspec.Raw``), so every field pdclient does not own reaches the
servers byte for byte (an integer beyond 64 bits stays an integer). Only the fields the
contract names are written:

- prefill leg: ``stream: false``, no ``stream_options``, ``max_tokens: 1`` (and
  ``max_completion_tokens: 1`` if present), no ``min_tokens``, ``n: 1``, no ``best_of``,
  ``return_token_ids: true``, ``kv_transfer_params: PREFILL_KV_TRANSFER_PARAMS``;
- decode leg: the caller's fields plus ``kv_transfer_params`` = the prefill's object with
  ``"prompt_token_ids": ids`` added (chat), or ``prompt`` = the ids (completions);
- ``pdclient`` (the per-call options) never reaches a server;
- no request pdclient forwards, P/D or pass-through, carries a ``kv_transfer_params``
  it did not write (``check_forwarded_body``, ``UploadScan``).

The prefill's id list is never decoded into Python ints: it is located in the response
bytes, checked to be a non-empty array of non-negative integers on the bytes, and
spliced into the decode body as it came. See docs/ARCHITECTURE.md, "The wire contract".
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote_to_bytes

import msgspec
import orjson

from .._errors import PDConfigError
from ._call_options import CALL_OPTIONS_KEY, CallOptions, parse_call_options
from ._parts import has_media

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


class Refusal(ValueError):
    """The caller's request cannot take a P/D handoff; the message says why (a 400)."""


# -- what no caller may send -------------------------------------------------------------

KV_TRANSFER_PARAMS = "kv_transfer_params"
_KV_KEY = KV_TRANSFER_PARAMS.encode("ascii")
_XARGS = "vllm_xargs"
"""vLLM copies this object into the request's ``extra_args``, where the KV connector reads
``kv_transfer_params`` too; its form endpoints (speech to text) read it as a JSON string."""
_FORM_MARKERS = (_KV_KEY, _XARGS.encode("ascii"))
_NOT_JSON = object()
MULTIPART = "multipart/form-data"
_URLENCODED = "application/x-www-form-urlencoded"


def media_type(content_type: str | None) -> str:
    """``type/subtype`` of a content-type header, lower-case, without its parameters."""
    return (content_type or "").partition(";")[0].strip().lower()


def check_content_encoding(content_encoding: str | None) -> None:
    """Refuse a compressed request body: vLLM reads bodies as sent (it decodes no
    content-encoding), and pdclient forwards none whose fields it cannot check."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
    if any(c not in ("", "identity") for c in codings):
        raise Refusal(
            f"content-encoding {content_encoding!r}: pdclient forwards only uncompressed request bodies "
            f"(it checks each for {KV_TRANSFER_PARAMS}, and vLLM does not decompress them); send it uncompressed"
        )


def check_forwarded_body(content: bytes, content_type: str | None, content_encoding: str | None) -> None:
    """Refuse (``Refusal``) a body, read whole, that could give vLLM a ``kv_transfer_params``.

    Whatever the path and the content-type: vLLM parses a body without a content-type as
    JSON, and some of its routes (``/invocations``) parse it as JSON whatever the header
    says, so every body that parses as JSON (as Python's ``json`` parses it: NaN, UTF-16,
    a byte-order mark) is checked, at any depth, its keys unescaped and duplicates seen. A
    form is checked by its bytes (``UploadScan``; an url-encoded one also percent-decoded).
    """
    if content:
        check_content_encoding(content_encoding)
    kind = media_type(content_type)
    if kind == MULTIPART:
        UploadScan().feed(content)
        return
    if kind == _URLENCODED:
        UploadScan(multipart=False).feed(unquote_to_bytes(content.replace(b"+", b" ")))
    where = kv_params_in_json(content)
    if where is not None:
        raise Refusal(_kv_refusal("" if where == KV_TRANSFER_PARAMS else f"at {where}"))


def _kv_refusal(found: str) -> str:
    if len(found) > 120:  # a path through deep nesting: its ends say enough
        found = f"{found[:40]}...{found[-77:]}"
    where = f", found {found}" if found else ""
    return f"{KV_TRANSFER_PARAMS} is written by pdclient; remove it from the request (extra_body){where}"


def kv_params_in_json(content: bytes) -> str | None:
    """Where a ``kv_transfer_params`` key is in a JSON body (``vllm_xargs.kv_transfer_params``),
    or None: none, or not JSON. Bytes without the name or a ``\\u`` escape are not parsed."""
    try:
        encoding = json.detect_encoding(content)
    except (TypeError, ValueError):
        return None
    if encoding in ("utf-8", "utf-8-sig"):
        if _KV_KEY not in content and b"\\u" not in content:
            return None
        try:
            value = orjson.loads(content)
        except orjson.JSONDecodeError:  # what orjson refuses and Python reads: NaN, 2**64, a BOM, ...
            value = _python_json(content)
    else:
        value = _python_json(content)
    return None if value is _NOT_JSON else _kv_params_key(value)


def _python_json(content: bytes | str) -> Any:
    """The body as Starlette's ``Request.json()`` reads it (``json.loads``), or ``_NOT_JSON``."""
    try:
        return json.loads(content)
    except ValueError:
        return _NOT_JSON
    except RecursionError:
        # A server with more stack (or a higher limit) might read what this process cannot check.
        raise Refusal("request body: JSON nested deeper than pdclient can check") from None


def _kv_params_key(value: object) -> str | None:
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, dict):
            for key, child in item.items():
                here = f"{path}.{key}" if path else str(key)
                if key == KV_TRANSFER_PARAMS:
                    return here
                if key == _XARGS and isinstance(child, str):
                    child = _python_json(child)  # vLLM's form requests decode a string vllm_xargs
                if isinstance(child, dict | list):
                    stack.append((child, here))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in enumerate(item) if isinstance(child, dict | list))
    return None


class UploadScan:
    """A form body's bytes as they go by (a multipart upload streams unread): ``feed`` raises
    ``Refusal`` before the bytes that could give vLLM a ``kv_transfer_params`` leave.

    vLLM's form endpoints (speech to text) have no ``kv_transfer_params`` field, but read a
    ``vllm_xargs`` field as JSON, and a ``kv_transfer_params`` key in it reaches the KV
    connector (a list there crashes a NIXL engine). The form parser vLLM runs on
    (python-multipart, under Starlette) decodes no escapes in a part's name but ``\\\\``
    and ``\\"``, and ignores ``name*=``, so neither name can be spelt without its bytes:
    they are looked for anywhere in the body, files included (an upload holding them by
    chance is refused, naming them). A multipart body must also start with ``--`` (its
    boundary): it then cannot be JSON, which ``/invocations`` reads whatever the content-type.
    """

    _KEEP = max(map(len, _FORM_MARKERS)) - 1

    def __init__(self, *, multipart: bool = True) -> None:
        self._head = b"" if multipart else b"--"
        self._tail = b""

    def feed(self, chunk: bytes) -> None:
        if len(self._head) < 2:
            self._head += chunk[: 2 - len(self._head)]
            if not b"--".startswith(self._head):
                raise Refusal(f"a {MULTIPART} body must start with its boundary (--)")
        window = self._tail + chunk
        for marker in _FORM_MARKERS:
            if marker in window:
                name = marker.decode("ascii")
                if marker == _KV_KEY:
                    raise Refusal(_kv_refusal("in a form"))
                raise Refusal(
                    f"{name} in a form: pdclient refuses it (vLLM reads it as JSON, and a {KV_TRANSFER_PARAMS} "
                    "key there would reach the KV connector)"
                )
        self._tail = window[-self._KEEP :]


# -- the caller's body -------------------------------------------------------------------


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


def plan_call(kind: Kind, content: bytes, tenant: str | None = None) -> Plan:
    """Read the caller's body; raises ``Refusal`` for a request that cannot be split."""
    fields = read_fields(content)
    options = _take_call_options(fields)
    if KV_TRANSFER_PARAMS in fields:  # its name unescaped, duplicates seen
        raise Refusal(_kv_refusal(""))
    nested = kv_params_in_json(content)  # e.g. in vllm_xargs, which vLLM hands to the connector too
    if nested is not None:
        raise Refusal(_kv_refusal(f"at {nested}"))
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


# -- the legs' bodies --------------------------------------------------------------------


def _one_token(fields: Fields) -> dict[str, msgspec.Raw]:
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
    fields = _one_token(plan.fields)
    fields["return_token_ids"] = _TRUE
    fields["kv_transfer_params"] = _PREFILL_KV_RAW
    return encode_fields(fields)


def warm_up_body(plan: Plan) -> bytes:
    """A prefill warm-up (``fleet._warm``): the caller's call as a one-token call, and nothing more.

    No ``kv_transfer_params``: the server caches the prompt's blocks as for any call and
    holds nothing for a decode that will not come.
    """
    return encode_fields(_one_token(plan.fields))


def prefill_body_for_ids(plan: Plan, ids: bytes) -> bytes:
    """A prefill leg whose prompt is given as token ids (a JSON array), not rendered.

    Chat: the ids ride in ``kv_transfer_params.prompt_token_ids`` next to
    ``do_remote_decode`` (vLLM 0.27+ honours them on this leg too); completions: the
    ``prompt`` is the ids. Used by a migrated decode (pdclient/migration/_core.py).
    """
    fields = _one_token(plan.fields)
    fields["return_token_ids"] = _TRUE
    if plan.kind is Kind.CHAT:
        fields["kv_transfer_params"] = msgspec.Raw(_with_ids(bytes(_PREFILL_KV_RAW), ids))
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
    compact = _read_compact(kind, content)
    return compact if compact is not None else _read_parsed(kind, content)


def _read_compact(kind: Kind, content: bytes) -> PrefillResult | None:
    """The fast path, for the compact JSON vLLM writes; None when it cannot vouch for the result.

    The id array is cut out of the body and the rest (a few KB) is decoded, which checks
    that the array cut out is the very field the contract names. The array itself is
    checked on its bytes: digits and commas only, and as many ids as the prefill's own
    ``usage.prompt_tokens`` (which also rules out an empty item). No id becomes a Python object.
    """
    at = content.rfind(_IDS_KEY)
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
    inner = array[1:-1]
    if not inner or inner[:1] == b"," or inner[-1:] == b",":
        return 0
    commas = inner.translate(None, _DIGITS)
    if commas.translate(None, b","):
        return 0
    count = len(commas) + 1
    if expected is None:
        return 0 if b",," in inner else count
    return count if count == expected else 0


def _with_ids(kv_params: bytes | None, ids: bytes) -> bytes:
    """The prefill's ``kv_transfer_params`` object with ``"prompt_token_ids": ids`` appended."""
    if kv_params is None or kv_params.strip() == b"{}":
        return b'{"prompt_token_ids":' + ids + b"}"
    return kv_params.rstrip()[:-1] + b',"prompt_token_ids":' + ids + b"}"


def decode_fields(plan: Plan, prefill: PrefillResult | None) -> dict[str, msgspec.Raw]:
    """The decode leg's fields: the caller's, with the prefill's handoff attached.

    The prefill's ``kv_transfer_params`` go through whole and unmodified (they belong to
    its KV connector). The ids are never extended by the prefill's sampled token: the
    decode prompt must have the prefill's length for the connector's block accounting.
    """
    fields = dict(plan.fields)
    if prefill is None:
        return fields
    ids = prefill.ids if plan.ids_skipped is None else None
    kv = prefill.kv_transfer_params
    if ids is not None and plan.kind is Kind.COMPLETIONS:
        # vLLM takes a token-id prompt on /completions natively, in every version.
        fields["prompt"] = msgspec.Raw(ids)
    elif ids is not None:
        # Chat, and the APIs vLLM renders through chat's preprocess_chat (Responses, Messages).
        kv = _with_ids(kv, ids)
    if kv is not None and kv.strip() != b"{}":
        fields["kv_transfer_params"] = msgspec.Raw(kv)
    return fields


def decode_body(plan: Plan, prefill: PrefillResult | None) -> bytes:
    return encode_fields(decode_fields(plan, prefill))


def release_body(plan: Plan, prefill: PrefillResult) -> bytes:
    """A one-token decode that completes an abandoned handoff.

    The prefill server keeps a request's KV blocks until a decode pulls them (or until
    the connector's timeout, minutes later). When the caller goes away between the two
    legs, this minimal decode pulls them so the prefill server frees them at once.
    """
    return encode_fields(_one_token(decode_fields(plan, prefill)))


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
