"""What no caller may send: a ``kv_transfer_params`` pdclient did not write, in any body it
forwards (JSON, forms, multipart uploads as they stream: ``UploadScan``), nor a body
encoding it cannot read."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import unquote_to_bytes

import orjson


class Refusal(ValueError):
    """The caller's request cannot take a P/D handoff; the message says why (a 400)."""


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
        raise Refusal(kv_refusal("" if where == KV_TRANSFER_PARAMS else f"at {where}"))


def kv_refusal(found: str) -> str:
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
                    raise Refusal(kv_refusal("in a form"))
                raise Refusal(
                    f"{name} in a form: pdclient refuses it (vLLM reads it as JSON, and a {KV_TRANSFER_PARAMS} "
                    "key there would reach the KV connector)"
                )
        self._tail = window[-self._KEEP :]
