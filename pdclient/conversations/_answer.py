"""The answer a caller received, read from the decode body as it was handed on: ``AnswerCollector``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import orjson

from ..wire import EventTooLarge, ParsedEvent, SSEFramer, event_json, is_done, single_line_data


@dataclass(frozen=True)
class Answer:
    """What the decode server streamed for a turn."""

    content: str | None
    tool_calls: Sequence[Mapping[str, Any]] = ()
    """Assembled from the stream: ``{"id", "type", "function": {"name", "arguments"}}``."""
    completion_tokens: int | None = None
    """From the final usage chunk, when the stream had one."""
    reasoning: bool = False
    """Whether the answer had reasoning content (templates drop or reformat it)."""


_MAX_JSON_ANSWER = 8 * 1024 * 1024
"""A non-streamed answer body larger than this is not remembered (it is buffered whole)."""
_EVENT_BATCH_BYTES = 64 * 1024
"""A streamed answer's bytes are read once this many have gathered (and at its end): in
one pass over whole events, not event by event as they are handed on. A token's event
is ~200 bytes, so a batch is a few hundred of them; the bytes held per call stay bounded."""


class _Delta(msgspec.Struct, gc=False):
    content: Any = None
    reasoning_content: Any = None
    reasoning: Any = None
    tool_calls: Any = None


class _Choice(msgspec.Struct, gc=False):
    index: Any = 0
    delta: _Delta | None = None
    finish_reason: Any = None


class _Chunk(msgspec.Struct, gc=False):
    """The fields of a chat stream's event the answer is read from; msgspec skips the rest
    (ids, model, logprobs) without building them, which is most of what parsing an event
    into dicts costs."""

    choices: list[_Choice] | None = None
    usage: Any = None


_CHUNK = msgspec.json.Decoder(_Chunk)


class AnswerCollector:
    """The answer a caller received, from the decode body's bytes as they were handed on.

    ``feed`` takes the body's bytes as they come and keeps them; they are read later, in
    batches (``_EVENT_BATCH_BYTES``, then the rest when the answer is asked for): streamed
    (SSE), each whole event's data parsed, and only the answer kept (its text, its tool
    calls, whether it had reasoning, the final usage); non-streamed, the JSON body (up to
    8 MB) parsed whole. Read on the way instead, event by event, the answer cost a
    conversation's streamed call ~1 ms of CPU more than a call without one (on the CPU
    pair's AMD EPYC). A batch of vLLM's events (one ``data:`` line each) is decoded as chat
    chunks (``_Chunk``) and not framed into dicts: a 40-token answer's read cost ~125 us
    of CPU instead of ~290 (the Zen 3 EPYC); any other batch is framed and parsed as
    before. ``answer()`` is None unless the answer is whole (a ``finish_reason`` seen) and
    has one choice.
    """

    def __init__(self, *, stream: bool) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self._framer = SSEFramer()
        self._content: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._reasoning = False
        self._finished = False
        self._spoiled = False
        self._completion_tokens: int | None = None
        self._prompt_tokens: int | None = None
        self._cached_tokens: int | None = None

    @property
    def completion_tokens(self) -> int | None:
        """``usage.completion_tokens`` as the decode server reported it, when it did."""
        self._read()
        return self._completion_tokens

    @property
    def prompt_tokens(self) -> int | None:
        """``usage.prompt_tokens`` as the decode server reported it, when it did."""
        self._read()
        return self._prompt_tokens

    @property
    def cached_tokens(self) -> int | None:
        """``usage.prompt_tokens_details.cached_tokens`` as the decode server reported it
        (its prefix-cache hits; servers run with ``--enable-prompt-tokens-details``)."""
        self._read()
        return self._cached_tokens

    def feed(self, data: bytes) -> None:
        """Bytes of the answer's body, as they come (an event may be cut anywhere)."""
        if self._spoiled or not data:
            return
        self._buffer += data
        if self._stream:
            if len(self._buffer) >= _EVENT_BATCH_BYTES:
                self._read_events(end=False)
        elif len(self._buffer) > _MAX_JSON_ANSWER:
            self._spoil()

    def feed_events(self, events: Sequence[bytes]) -> None:
        """Whole events of a streamed answer; one whose data a step parsed already
        (``wire.ParsedEvent``) is not parsed again, unless bytes before it wait to be read."""
        for event in events:
            if type(event) is ParsedEvent and not self._buffer and not self._framer.pending:
                self._event(event.payload)
            else:
                self.feed(event)

    @property
    def whole(self) -> bool:
        """Whether the answer was read to its end (``answer`` gives it)."""
        self._read()
        return self._finished and not self._spoiled

    def answer(self) -> Answer | None:
        """The whole answer, or None (cut, abandoned, several choices, not parsable)."""
        if not self.whole:
            return None
        calls = [self._tool_calls[i] for i in sorted(self._tool_calls)]
        content = "".join(self._content) if self._content or not calls else None
        return Answer(content, tuple(calls), self._completion_tokens, self._reasoning)

    def _read(self) -> None:
        """Read what was fed and not read yet (the body is over when this is asked)."""
        if self._spoiled:
            return
        if self._stream:
            if self._buffer or self._framer.pending:
                self._read_events(end=True)
        elif self._buffer:
            body, self._buffer = bytes(self._buffer), bytearray()
            self._parse_json(body)

    def _read_events(self, *, end: bool) -> None:
        data, self._buffer = bytes(self._buffer), bytearray()
        if self._read_chunks(data):
            return
        try:
            events = self._framer.feed(data) if data else []
            if end and (rest := self._framer.rest()):
                events.append(rest)
        except EventTooLarge:
            self._spoil()
            return
        for event in events:
            self._event(event_json(event))
            if self._spoiled:
                return

    def _read_chunks(self, data: bytes) -> bool:
        """Whole events of one ``data:`` line each (vLLM's), read as chat chunks; False, and
        nothing read, for anything else (those are framed and parsed as dicts instead).

        Every event is decoded before any is read, so one that is not a chunk (not JSON, a
        field of an unexpected type) leaves the whole batch to the other path."""
        values = single_line_data(data) if self._framer.whole(data) else None
        if values is None:
            return False
        try:
            chunks = [_CHUNK.decode(value) for value in values if not is_done(value)]
        except msgspec.DecodeError:
            return False
        for chunk in chunks:
            self._usage(chunk.usage)
            for choice in chunk.choices or ():
                if choice.index != 0:
                    self._spoil()
                    return True
                delta = choice.delta
                if delta is not None:
                    self._text(delta.content, delta.reasoning_content or delta.reasoning)
                    self._tool_parts(delta.tool_calls)
                if choice.finish_reason is not None:
                    self._finished = True
        return True

    def _spoil(self) -> None:
        self._spoiled = True
        self._buffer = bytearray()
        self._content = []

    def _event(self, chunk: object) -> None:
        """One streamed event's data, parsed (None: an event without data, or ``[DONE]``);
        anything but a JSON object spoils the answer."""
        if chunk is None:
            return
        if not isinstance(chunk, dict):
            self._spoil()
            return
        self._usage(chunk.get("usage"))
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                self._spoil()  # n > 1: which one goes on is the caller's choice
                return
            self._delta(choice.get("delta"))
            if choice.get("finish_reason") is not None:
                self._finished = True

    def _text(self, content: object, reasoning: object) -> None:
        """A message's (or a delta's) text, and whether it reasoned: the same keys in both."""
        if isinstance(content, str):
            self._content.append(content)
        if reasoning:
            self._reasoning = True

    def _delta(self, delta: object) -> None:
        if not isinstance(delta, dict):
            return
        self._text(delta.get("content"), delta.get("reasoning_content") or delta.get("reasoning"))
        self._tool_parts(delta.get("tool_calls"))

    def _tool_parts(self, parts: object) -> None:
        """A delta's pieces of tool calls, added to the calls they continue."""
        if not isinstance(parts, list):
            return
        for part in parts:
            if not isinstance(part, dict):
                continue
            index = part.get("index", 0)
            call = self._tool_calls.setdefault(
                index if isinstance(index, int) else 0, {"id": None, "type": "function", "function": {}}
            )
            for name in ("id", "type"):
                if part.get(name) is not None:
                    call[name] = part[name]
            function = part.get("function")
            if isinstance(function, dict):
                for name in ("name", "arguments"):
                    piece = function.get(name)
                    if isinstance(piece, str):
                        call["function"][name] = call["function"].get(name, "") + piece

    def _usage(self, usage: object) -> None:
        if not isinstance(usage, dict):
            return
        for name in ("completion_tokens", "prompt_tokens"):
            value = usage.get(name)
            if type(value) is int and value >= 0:
                setattr(self, f"_{name}", value)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(cached) is int and cached >= 0:
            self._cached_tokens = cached

    def _parse_json(self, body: bytes) -> None:
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            self._spoil()
            return
        choices = payload.get("choices") if isinstance(payload, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            self._spoil()
            return
        assert isinstance(payload, dict)
        self._usage(payload.get("usage"))
        message = choices[0].get("message")
        if not isinstance(message, dict):
            self._spoil()
            return
        self._text(message.get("content"), message.get("reasoning_content") or message.get("reasoning"))
        calls = message.get("tool_calls") or []
        if isinstance(calls, list):
            self._tool_calls = {i: c for i, c in enumerate(calls) if isinstance(c, dict)}
        self._finished = choices[0].get("finish_reason") is not None
