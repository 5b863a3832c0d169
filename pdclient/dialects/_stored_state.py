"""Which decode endpoint holds a stored response: a tag in the response id, no shared state.

vLLM keeps a stored response (``VLLM_ENABLE_RESPONSES_API_STORE=1``) in the memory of
the server that answered it, so a later call naming it (``previous_response_id``,
``GET /responses/{id}``, ``POST /responses/{id}/cancel``) must reach that server. Every
Responses answer from a decode endpoint gets its ids tagged on the way out
(``resp_<id>.pd<tag>``), and a tagged id coming in is stripped before it is forwarded
(the server sees its own id) and names the endpoint to pin. The tag is an HMAC of the
endpoint's URL as configured (credentials redacted), keyed with the operator's secret
(``reuse_secret``), so every process and replica given that secret computes the same one
and nobody without it can tell from a tag which server it names. Without a secret the key
is a fixed one: the tag still routes, but whoever can guess the candidate URLs (every port
of a host) can hash them and find the server. A tag no configured endpoint has any more
(the pool changed, or the secret did) routes as an untagged id does, and that server
answers (its 404).

The ids stay opaque strings to the openai and Agents SDKs: ASCII letters, digits, ``_``
and ``.``, valid in a URL path segment as they are.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import re
from collections.abc import Iterable
from typing import Any

import orjson

from .. import wire

TAG_LENGTH = 10
"""Base32 characters of the tag: 50 bits, ample to tell a pool's endpoints apart."""
_SEPARATOR = ".pd"
_KEY = b"pdclient decode endpoint of a stored response\x00"
"""Hashed with the URL without a secret (every process derives the same tag); with one,
the secret's HMAC of it keys the tags: a key of their own (the secret itself signs the legs)."""
MAX_ID_LENGTH = 256
"""The longest ``request_id`` or (untagged) ``previous_response_id`` a Responses call may
carry, in characters: vLLM's own ids are ~40 (``resp_`` and 32 hex digits), and vLLM
echoes each in its answer, whose ids are tagged on the way out."""
_TAGGED = re.compile(rf"\.pd([a-z2-7]{{{TAG_LENGTH}}})\Z")
_RESPONSE_PATH = re.compile(r"/responses/([^/]+)(/cancel|/input_items)?/?\Z")
"""The pass-through routes that name a stored response (vLLM 0.32 serves GET and ``/cancel``)."""
_RESPONSE_KEY = b'"response"'
_ID_FIELDS = tuple(
    (name, re.compile(rb'("%s"\s*:\s*)("[^"\\]*(?:\\.[^"\\]*)*")' % name.encode("ascii")))
    for name in ("id", "previous_response_id")
)
"""Each id field and where it stands with its value (a JSON string) in the raw answer:
compiled once, in linear time on any id (a pattern per id cost ~1 s per MB to compile)."""


@functools.lru_cache(maxsize=256)
def endpoint_tag(url: str, secret: str | None = None) -> str:
    """The tag of a decode endpoint's URL: the same in every process that configures it
    alike with the same ``secret`` (``PDOptions.reuse_secret``; None: the fixed key)."""
    named = wire.redact_url(url).encode("utf-8")
    if secret is None:  # as before secrets keyed it: tags already handed out still route
        digest = hashlib.sha256(_KEY + named).digest()
    else:
        digest = hmac.digest(hmac.digest(secret.encode("utf-8"), _KEY, hashlib.sha256), named, hashlib.sha256)
    return base64.b32encode(digest).decode("ascii")[:TAG_LENGTH].lower()


def _check(response_id: object) -> str:
    if not isinstance(response_id, str):
        raise TypeError(f"a response id is a string, got {type(response_id).__name__}")
    return response_id


def untag_id(response_id: str) -> tuple[str, str | None]:
    """The server's own id and the endpoint tag it carries, if it carries one."""
    match = _TAGGED.search(_check(response_id))
    if match is None or match.start() == 0:
        return response_id, None
    return response_id[: match.start()], match.group(1)


def tag_id(response_id: str, tag: str) -> str:
    """``response_id`` carrying ``tag``; an empty or already tagged id comes back unchanged."""
    if not _check(response_id) or untag_id(response_id)[1] is not None:
        return response_id
    return f"{response_id}{_SEPARATOR}{tag}"


def endpoint_for(tag: str | None, urls: Iterable[str], secret: str | None = None) -> str | None:
    """The URL among ``urls`` (the pool now) whose tag under ``secret`` is ``tag``; None if none is."""
    if tag is None:
        return None
    return next((url for url in urls if endpoint_tag(url, secret) == tag), None)


def untag_path(relative_path: str) -> tuple[str, str | None]:
    """A pass-through path naming a stored response, its id's tag stripped, and the tag."""
    match = _RESPONSE_PATH.match(relative_path)
    if match is None:
        return relative_path, None
    own, tag = untag_id(match.group(1))
    if tag is None:
        return relative_path, None
    return relative_path[: match.start(1)] + own + relative_path[match.end(1) :], tag


def names_a_response(relative_path: str) -> bool:
    """Whether a pass-through path's answer is a stored response (its ids get the tag)."""
    return _RESPONSE_PATH.match(relative_path) is not None


def _tag_payload(raw: bytes, response: object, tag: str) -> bytes | None:
    """``raw`` (JSON holding ``response``) with the response's ids tagged; None if none changed.

    Each id is replaced where it stands as its field's value (``"id": "resp_..."``), so
    every other byte stays as the server sent it. An id the search cannot find as written
    (escapes vLLM never writes) stays as it is: a call naming it is routed as an untagged
    one is."""
    if not isinstance(response, dict):
        return None
    out = raw
    for name, field in _ID_FIELDS:
        own = response.get(name)
        if isinstance(own, str) and (new := tag_id(own, tag)) != own:
            out = field.sub(functools.partial(_tagged_value, orjson.dumps(own), orjson.dumps(new)), out)
    return None if out == raw else out


def _tagged_value(written: bytes, tagged: bytes, match: re.Match[bytes]) -> bytes:
    """A field's value replaced by ``tagged`` where it is the id as written, else as it was."""
    return match.group(1) + tagged if match.group(2) == written else match.group(0)


def tag_json(body: bytes, tag: str) -> bytes:
    """A non-streamed Responses body with its ids tagged; the same bytes when there are none."""
    try:
        payload: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    out = _tag_payload(body, payload, tag)
    return body if out is None else out


def tag_event(event: bytes, tag: str) -> bytes:
    """One SSE event with its ``response``'s ids tagged (``response.created``, ``.completed``, ...)."""
    if _RESPONSE_KEY not in event:
        return event
    data = wire.event_data(event)
    if data is None:
        return event
    try:
        payload: Any = orjson.loads(data)
    except orjson.JSONDecodeError:
        return event
    if not isinstance(payload, dict):
        return event
    out = _tag_payload(event, payload.get("response"), tag)
    return event if out is None else out


class IdTags:
    """A Responses answer on its way to the caller, its response ids tagged with its endpoint's.

    Streamed: passed on in whole SSE events, as they complete, each byte as sent but the
    ids. JSON: held until whole, then tagged once.
    """

    __slots__ = ("_buffer", "_framer", "_tag", "stream")

    def __init__(self, tag: str, *, stream: bool) -> None:
        self._tag = tag
        self.stream = stream
        self._buffer = b""
        self._framer = wire.SSEFramer()

    def feed(self, data: bytes) -> bytes:
        """The body bytes just read; returns what goes to the caller now."""
        if not self.stream:
            self._buffer += data
            return b""
        return wire.pass_events(self._framer, data, self.event)

    def event(self, raw: bytes) -> bytes:
        """One whole event of the stream, its response's ids tagged."""
        return tag_event(raw, self._tag)

    def end(self) -> bytes:
        """The rest, once the body is whole."""
        if self.stream:
            return tag_event(self._framer.rest(), self._tag)
        rest, self._buffer = self._buffer, b""
        return tag_json(rest, self._tag)
