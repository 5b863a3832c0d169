"""The answer a caller received, read from the decode body as it was handed on: ``AnswerCollector``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson


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


class AnswerCollector:
    """The answer a caller received, from the decode body as it was handed on.

    Streamed (SSE): the stream's one framer hands each whole event's parsed data to
    ``event`` (``wire.event_json``), and only the answer is kept (its text, its tool
    calls, whether it had reasoning, the final usage). Non-streamed: the JSON body is
    ``feed``-ed, kept (up to 8 MB) and parsed at the end. ``answer()`` is None unless the
    answer is whole (a ``finish_reason`` seen) and has one choice.
    """

    def __init__(self, *, stream: bool) -> None:
        self._stream = stream
        self._buffer = bytearray()
        self._content: list[str] = []
        self._tool_calls: dict[int, dict[str, Any]] = {}
        self._reasoning = False
        self._finished = False
        self._spoiled = False
        self.completion_tokens: int | None = None
        self.prompt_tokens: int | None = None
        """``usage.prompt_tokens`` as the decode server reported it, when it did."""
        self.cached_tokens: int | None = None
        """``usage.prompt_tokens_details.cached_tokens`` as the decode server reported it
        (its prefix-cache hits; servers run with ``--enable-prompt-tokens-details``)."""

    def feed(self, data: bytes) -> None:
        """Bytes of a non-streamed answer's JSON body."""
        if self._spoiled or not data:
            return
        self._buffer += data
        if len(self._buffer) > _MAX_JSON_ANSWER:
            self._spoil()

    def answer(self) -> Answer | None:
        """The whole answer, or None (cut, abandoned, several choices, not parsable)."""
        if not self._stream and not self._spoiled and not self._finished:
            self._parse_json(bytes(self._buffer))
            self._buffer = bytearray()
        if self._spoiled or not self._finished:
            return None
        calls = [self._tool_calls[i] for i in sorted(self._tool_calls)]
        content = "".join(self._content) if self._content or not calls else None
        return Answer(content, tuple(calls), self.completion_tokens, self._reasoning)

    def _spoil(self) -> None:
        self._spoiled = True
        self._buffer = bytearray()
        self._content = []

    def event(self, chunk: object) -> None:
        """One streamed event's data, parsed (None: an event without data, or ``[DONE]``);
        anything but a JSON object spoils the answer."""
        if self._spoiled or chunk is None:
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

    def _text(self, message: dict[str, Any]) -> None:
        """A message's (or a delta's) text, and whether it reasoned: the same keys in both."""
        content = message.get("content")
        if isinstance(content, str):
            self._content.append(content)
        if message.get("reasoning_content") or message.get("reasoning"):
            self._reasoning = True

    def _delta(self, delta: object) -> None:
        if not isinstance(delta, dict):
            return
        self._text(delta)
        for part in delta.get("tool_calls") or ():
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
                setattr(self, name, value)
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if type(cached) is int and cached >= 0:
            self.cached_tokens = cached

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
        self._text(message)
        calls = message.get("tool_calls") or []
        if isinstance(calls, list):
            self._tool_calls = {i: c for i, c in enumerate(calls) if isinstance(c, dict)}
        self._finished = choices[0].get("finish_reason") is not None
