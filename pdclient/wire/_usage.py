"""The caller's ``usage`` for a P/D call, from the two legs' usage: pure functions on bytes.

What vLLM 0.32 reports (measured on the local NIXL pair, ``--enable-prompt-tokens-details``):

- prefill leg (non-streamed, ``max_tokens: 1``): ``prompt_tokens`` = the prompt's ids,
  ``completion_tokens: 1`` (the forced token, never the caller's), ``prompt_tokens_details``
  = ``{cached_tokens: its prefix-cache hits, created_cache_tokens: the whole blocks it
  newly cached, multimodal_tokens: null}``; its ``kv_transfer_params`` carry
  ``remote_prefill_cached_tokens`` (the same hits) and ``remote_num_tokens``;
- decode leg (streamed, ``stream_options.include_usage``; the usage arrives in a last chunk
  whose ``choices`` is empty): ``prompt_tokens`` = the prompt's ids (the same count),
  ``completion_tokens`` = the answer's. Its ``cached_tokens`` is the prefill's hits: vLLM
  0.32 reports the ``remote_prefill_cached_tokens`` it received instead of its own ~100 %
  (the pulled KV counts as a hit there); older servers report their own. Its
  ``created_cache_tokens`` is 0 on the P/D path, whatever the prefill cached;
- a decode-only call (streamed or not) reports the decode server's own figures, which are
  the end-to-end ones: nothing to merge;
- ``prompt_tokens_details`` is absent unless the server runs with
  ``--enable-prompt-tokens-details``.

The merge, as vllm-router does it (``src/routers/http/usage_merge.rs``): the input side
(``prompt_tokens`` and ``prompt_tokens_details``) from the prefill, the output side from
the decode, ``total_tokens`` recomputed; a decode ``cached_tokens`` is dropped when the
prefill reported no details. llm-d's sidecar passes the decode's usage through unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from ._forwarded import Refusal
from ._plan import encode_fields, field_value, read_fields
from ._sse import SSEFramer, event_json, pass_events, split_events

USAGE_KEY = b'"usage"'

PayloadMerge = Callable[[dict[str, Any], Mapping[str, Any], bool], bool]
"""How one API merges the prefill's usage into a decode payload, in place: ``(payload,
prefill, streamed)``, True when it changed it. Chat's (``merge_chat_payload``) is the default;
the other APIs' live in their dialects (``pdclient.dialects``)."""


def merge_chat_payload(payload: dict[str, Any], prefill: Mapping[str, Any], streamed: bool) -> bool:
    """Chat and completions: the body's ``usage``, or a stream's final usage event (``"choices": []``)."""
    if not isinstance(payload.get("usage"), dict) or (streamed and payload.get("choices") != []):
        return False
    merged = merge_usage(prefill, payload["usage"])
    if merged == payload["usage"]:
        return False
    payload["usage"] = merged
    return True


def prefill_usage(payload: object) -> dict[str, Any] | None:
    """The input side of a prefill response's usage, small enough to keep for a whole stream."""
    usage = payload.get("usage") if isinstance(payload, dict) else None
    if not isinstance(usage, dict) or not _is_count(usage.get("prompt_tokens")):
        return None
    kept: dict[str, Any] = {"prompt_tokens": usage["prompt_tokens"]}
    if isinstance(usage.get("prompt_tokens_details"), dict):
        kept["prompt_tokens_details"] = usage["prompt_tokens_details"]
    return kept


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 0


def merge_usage(prefill: Mapping[str, Any] | None, decode: Mapping[str, Any]) -> dict[str, Any]:
    """The caller's usage: prompt side from the prefill, completion side from the decode.

    Without a prefill usage (a decode-only call, or the prefill failed) the decode's usage
    is the end-to-end one and comes back unchanged.
    """
    merged = dict(decode)
    if prefill is None or not _is_count(prefill.get("prompt_tokens")):
        return merged
    merged["prompt_tokens"] = prefill["prompt_tokens"]
    details = prefill.get("prompt_tokens_details")
    if isinstance(details, Mapping):
        merged["prompt_tokens_details"] = dict(details)
    elif isinstance(merged.get("prompt_tokens_details"), Mapping):
        # The decode's figure would count the pulled KV as a cache hit.
        rest = {k: v for k, v in merged["prompt_tokens_details"].items() if k != "cached_tokens"}
        if rest:
            merged["prompt_tokens_details"] = rest
        else:
            merged.pop("prompt_tokens_details")
    completion = merged.get("completion_tokens")
    if _is_count(completion):
        merged["total_tokens"] = prefill["prompt_tokens"] + completion
    return merged


def merge_usage_json(body: bytes, prefill: Mapping[str, Any] | None, merge: PayloadMerge = merge_chat_payload) -> bytes:
    """A non-streamed response body with its usage merged; the same bytes when there is nothing to do."""
    if prefill is None or USAGE_KEY not in body:
        return body
    try:
        payload = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body
    if not isinstance(payload, dict) or not merge(payload, prefill, False):
        return body
    return orjson.dumps(payload)


def merge_usage_sse(data: bytes, prefill: Mapping[str, Any] | None, merge: PayloadMerge = merge_chat_payload) -> bytes:
    """SSE bytes with the final usage event rewritten; everything else byte for byte.

    Only whole events (ended by a blank line) are looked at, and only the final usage
    event (``"choices": []`` and a ``usage`` object; per-chunk usage of
    ``continuous_usage_stats`` keeps the prompt count, which is the same on both legs).
    A caller handing over the stream's last chunk (the one with ``data: [DONE]``, which
    vLLM sends right after the usage event) gets the event when it is whole in it.
    """
    if prefill is None or USAGE_KEY not in data:
        return data
    events, start = split_events(data)
    merged = _merged(events, prefill, merge)
    if merged is None:
        return data
    return merged + data[start:]


def _merged(events: list[bytes], prefill: Mapping[str, Any], merge: PayloadMerge) -> bytes | None:
    """The events' bytes with the final usage event rewritten; None if none was."""
    out: list[bytes] = []
    changed = False
    for event in events:
        rewritten = _rewrite_event(event, prefill, merge) if USAGE_KEY in event else None
        changed = changed or rewritten is not None
        out.append(event if rewritten is None else rewritten)
    return b"".join(out) if changed else None


def _rewrite_event(event: bytes, prefill: Mapping[str, Any], merge: PayloadMerge) -> bytes | None:
    return _rewritten(event, event_json(event), prefill, merge)


def _rewritten(event: bytes, payload: object, prefill: Mapping[str, Any], merge: PayloadMerge) -> bytes | None:
    """The event with its payload merged (in place) and written back; None when unchanged."""
    lines = event.splitlines(keepends=True)
    data_lines = [i for i, line in enumerate(lines) if line.startswith(b"data:")]
    if len(data_lines) != 1:
        return None  # multi-line data never comes from vLLM: leave it alone
    index = data_lines[0]
    line = lines[index]
    ending = line[len(line.rstrip(b"\r\n")) :]
    if not isinstance(payload, dict) or not merge(payload, prefill, True):
        return None
    lines[index] = b"data: " + orjson.dumps(payload) + ending
    return b"".join(lines)


class UsageMerge:
    """A decode body on its way to the caller, with its usage merged (``merge_usage``).

    Streamed: passed on in whole SSE events, as they complete (a partial event waits for
    its end, as every SSE client waits for it), the final usage event rewritten. JSON:
    held until whole (nothing reads half a JSON body), then rewritten once.
    """

    __slots__ = ("_buffer", "_framer", "_merge", "_prefill", "stream")

    def __init__(self, prefill: Mapping[str, Any], *, stream: bool, merge: PayloadMerge = merge_chat_payload) -> None:
        self._prefill = prefill
        self.stream = stream
        self._merge = merge
        self._buffer = b""
        self._framer = SSEFramer()

    def feed(self, data: bytes) -> bytes:
        """The body bytes just read; returns what goes to the caller now."""
        if not self.stream:
            self._buffer += data
            return b""
        return pass_events(self._framer, data, self.event)

    def event(self, raw: bytes, payload: object = None) -> bytes:
        """One whole event of the stream, the final usage event rewritten; ``payload``: its
        data already parsed (``sse.event_json``), else it is parsed here if it holds a usage."""
        if USAGE_KEY not in raw:
            return raw
        if payload is None:
            payload = event_json(raw)
        return _rewritten(raw, payload, self._prefill, self._merge) or raw

    def end(self) -> bytes:
        """The rest, once the body is whole."""
        if self.stream:
            return merge_usage_sse(self._framer.rest(), self._prefill, self._merge)
        rest, self._buffer = self._buffer, b""
        return merge_usage_json(rest, self._prefill, self._merge)


_ASK_USAGE = b',"stream_options":{"include_usage":true}}'
_STREAM_OPTIONS = b'"stream_options"'


def with_usage_asked(body: bytes) -> bytes:
    """A streamed leg's JSON body that also asks for the final usage event.

    A body without ``stream_options`` gets the field at the end of the object, with no
    re-encoding of the rest. A caller's own options without ``include_usage: true`` (vLLM's
    multi-turn benchmark sends ``{"include_usage": false}``) are re-encoded with it, and
    without ``continuous_usage_stats``: usage in every chunk is the caller's to ask for, and
    the one event asked here is taken out again (``UsageStrip``). Anything else (not a JSON
    object, options that are not one) goes as it is, for the server to judge."""
    stripped = body.rstrip()
    if not stripped.endswith(b"}") or stripped == b"{}":
        return body
    if _STREAM_OPTIONS not in body:
        return stripped[:-1] + _ASK_USAGE
    try:
        fields = read_fields(body)
        options = field_value(fields, "stream_options")
    except Refusal:
        return body
    if options is None:
        options = {}
    elif not isinstance(options, dict):
        return body
    options.pop("continuous_usage_stats", None)
    return encode_fields({**fields, "stream_options": {**options, "include_usage": True}})


def _is_usage_event(event: bytes, payload: object = None) -> bool:
    """Whether an SSE event is the final usage report (``"choices": []`` and a ``usage`` object);
    ``payload``: its data already parsed, else it is parsed here if it holds a usage."""
    if USAGE_KEY not in event:
        return False
    if payload is None:
        payload = event_json(event)
    return isinstance(payload, dict) and payload.get("choices") == [] and isinstance(payload.get("usage"), dict)


class UsageStrip:
    """A decode event stream on its way to the caller without the final usage event, which
    pdclient asked for itself (``with_usage_asked``) and the caller did not.

    Passed on in whole SSE events, as they complete (as ``UsageMerge`` does)."""

    __slots__ = ("_framer",)

    def __init__(self) -> None:
        self._framer = SSEFramer()

    def feed(self, data: bytes) -> bytes:
        return pass_events(self._framer, data, self.event)

    def event(self, raw: bytes, payload: object = None) -> bytes:
        """One whole event: b"" if it is the usage pdclient asked for, else as it came."""
        return b"" if _is_usage_event(raw, payload) else raw

    def end(self) -> bytes:
        rest = self._framer.rest()
        return b"" if _is_usage_event(rest) else rest
