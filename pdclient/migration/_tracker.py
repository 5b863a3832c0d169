"""An armed call's SSE body, event by event: the ids kept, the ids stripped, the id-only
chunks held back until the text they make reaches the caller."""

from __future__ import annotations

from typing import Any

import orjson

from ..wire import ParsedEvent, SSEFramer, event_data, is_done
from ._splice import Splice

_TOKEN_IDS = b',"token_ids":'
_PROMPT_TOKEN_IDS = b',"prompt_token_ids":'
_PROMPT_KEY = b'"prompt_token_ids":'


def _whole(event: bytes) -> list[bytes]:
    return [event] if event else []


class Tracker:
    """An armed call's SSE body, event by event: the ids the caller has, and the bytes it gets."""

    __slots__ = (
        "_framer",
        "_held",
        "_held_ids",
        "_splice",
        "chat",
        "choices",
        "done",
        "finished",
        "header",
        "ids",
        "keep_ids",
        "prompt_ids",
        "stopped",
        "usage_sent",
        "want_prompt_ids",
    )

    def __init__(self, *, chat: bool, keep_ids: bool, want_prompt_ids: bool, choices: int = 1) -> None:
        self.chat = chat
        self.choices = choices
        """How many choices the answer has (``n``); each one finishes on its own."""
        self.finished: dict[int, str] = {}
        """The ``finish_reason`` of each choice that sent one to the caller, by its index."""
        self.usage_sent = False
        """The final usage event (``choices: []``) went to the caller."""
        self.keep_ids = keep_ids
        """The caller asked for token ids: pass them on."""
        self.want_prompt_ids = want_prompt_ids
        """No prefill ids (the prefill failed): keep the decode's own, from its first chunk."""
        self.prompt_ids: list[int] | None = None
        self.ids: list[int] = []
        """Generated ids whose chunks reached the caller, in order."""
        self.stopped: str | None = None
        """Why the stream can no longer move (a tool call started, ...); None while it can."""
        self.done = False
        """``[DONE]`` went to the caller."""
        self.header: tuple[Any, Any, Any] | None = None
        """The original stream's ``id``, ``created`` and ``model``."""
        self._framer = SSEFramer()
        self._held: list[bytes] = []
        self._held_ids: list[int] = []
        self._splice: Splice | None = None

    def feed(self, data: bytes) -> bytes:
        """The body bytes just read; returns what goes to the caller now (whole events)."""
        return b"".join(self.events(data))

    def events(self, data: bytes) -> list[bytes]:
        """The body bytes just read; returns the events that go to the caller now, each whole
        and framed once (the caller's body takes them as they are: ``handoff.CallerBody``)."""
        return [piece for event in self._framer.feed(data) for piece in self._event(event)]

    def end(self) -> list[bytes]:
        """The body ended without ``[DONE]``: what is left, as it is."""
        rest = self._framer.rest()
        return [*self._flush(), rest] if rest else self._flush()

    @property
    def answered(self) -> bool:
        """Every choice has sent its ``finish_reason``: the answer is whole, whatever follows."""
        return len(self.finished) >= self.choices

    def cut(self) -> None:
        """The stream broke: drop what was not passed on (held chunks, a partial event)."""
        self._framer.rest()
        self._held.clear()
        self._held_ids.clear()

    def splice(self, prompt_tokens: int) -> None:
        """From now on the events are a continuation's: rewrite them into the caller's stream."""
        self._splice = Splice(self.header, prompt_tokens, len(self.ids), self.chat, self.keep_ids)

    def _stop(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason

    def _flush(self) -> list[bytes]:
        if not self._held:
            return []
        self.ids.extend(self._held_ids)
        self._held_ids.clear()
        held, self._held = self._held, []
        return held

    def _event(self, event: bytes) -> list[bytes]:
        payload = event_data(event)
        if payload is None:
            return [event]  # a comment, or a field vLLM does not send: as it is
        if len(payload) < 16 and is_done(payload):
            self.done = True
            return [*self._flush(), event]
        original = event
        if not self.want_prompt_ids and _PROMPT_KEY in payload:
            # The first chunk's prompt ids (thousands, with a long prompt) are cut out of the
            # bytes before parsing: pdclient has them already.
            cut = _cut(event, _PROMPT_TOKEN_IDS)
            if cut:
                event = cut
                payload = event_data(cut) or b""
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            self._stop("the decode sent an event that is not JSON")
            return [*self._flush(), event]
        if type(obj) is not dict:
            self._stop("the decode sent an event that is not a JSON object")
            return [*self._flush(), event]
        if self.header is None:
            self.header = (obj.get("id"), obj.get("created"), obj.get("model"))
        choices = obj.get("choices")
        choice = choices[0] if type(choices) is list and choices and type(choices[0]) is dict else None
        if "error" in obj:
            self._stop("the decode reported an error in the stream")
        if choice is None:
            if type(obj.get("usage")) is dict:
                self.usage_sent = True
            return [*self._flush(), *_whole(self._output(original, event, obj, None, None))]
        ids = choice.get("token_ids")
        finish = choice.get("finish_reason")
        if self.chat:
            delta = choice.get("delta")
            delta = delta if type(delta) is dict else {}
            if delta.get("tool_calls"):
                self._stop("a tool call had started")
            elif delta.get("reasoning") or delta.get("reasoning_content"):
                self._stop("reasoning had started")
            visible = bool(delta.get("content"))
        else:
            delta = None
            visible = bool(choice.get("text"))
        if self.want_prompt_ids and self.prompt_ids is None:
            prompt = (obj if self.chat else choice).get("prompt_token_ids")
            if type(prompt) is list and prompt:
                self.prompt_ids = prompt
        if type(ids) is not list:
            if visible:
                self._stop("the decode sent text without its token ids")
            ids = None
        out = self._output(original, event, obj, choice, delta)
        if not out:
            return []
        if self.stopped is None and ids and not visible and finish is None:
            self._held.append(out)
            self._held_ids.extend(ids)
            return []
        flushed = self._flush()
        if ids:
            self.ids.extend(ids)
        if finish is not None:
            index = choice.get("index", 0)
            self.finished[index if type(index) is int else 0] = str(finish)
        return [*flushed, out] if flushed else [out]

    def _output(
        self, original: bytes, event: bytes, obj: dict[str, Any], choice: dict[str, Any] | None, delta: Any
    ) -> bytes:
        """The event the caller gets; a ``ParsedEvent`` carrying ``obj`` where ``obj`` is its
        data, so the caller's steps (``handoff.CallerBody``) do not parse it again."""
        if self._splice is not None:
            spliced = self._splice.rewrite(obj, choice, delta)
            return ParsedEvent(spliced, obj) if spliced else spliced
        if self.keep_ids:
            return ParsedEvent(original, obj) if original is event else original
        out = event
        if choice is not None and "token_ids" in choice:
            out = _cut(out, _TOKEN_IDS)
        holder = obj if self.chat else choice
        if out and holder is not None and "prompt_token_ids" in holder:
            out = _cut(out, _PROMPT_TOKEN_IDS)
        if choice is not None:
            choice.pop("token_ids", None)
            choice.pop("prompt_token_ids", None)
        obj.pop("prompt_token_ids", None)
        if out:
            return ParsedEvent(out, obj)
        # Not the compact JSON vLLM writes: the event re-encoded without them.
        return ParsedEvent(b"data: " + orjson.dumps(obj) + b"\n\n", obj)


def _cut(event: bytes, key: bytes) -> bytes:
    """``event`` without the member ``key`` (``,"name":``) whose value is an id array or null; b"" if not found so."""
    at = event.find(key)
    if at < 0:
        return b""
    start = at + len(key)
    if event.startswith(b"[", start):
        end = event.find(b"]", start) + 1
        if end <= 0:
            return b""
    elif event.startswith(b"null", start):
        end = start + 4
    else:
        return b""
    return event[:at] + event[end:]
