"""A non-streamed call's JSON body, assembled from the events its decode leg streamed."""

from __future__ import annotations

from typing import Any

import orjson

from ..wire import SSEFramer, event_data, is_done


class CannotAssemble(Exception):
    """The decode's events do not make the answer a non-streamed call expects; the message says why."""


class _Choice:
    """One choice of the answer, as its events arrive."""

    __slots__ = (
        "content",
        "finish_reason",
        "logprobs",
        "prompt_token_ids",
        "reasoning",
        "reasoning_key",
        "role",
        "stop_reason",
        "text_logprobs",
        "token_ids",
        "tool_calls",
    )

    def __init__(self) -> None:
        self.role: Any = None
        self.content: list[str] = []
        """Chat: the content deltas; completions: the text deltas."""
        self.reasoning: list[str] = []
        self.reasoning_key = "reasoning"
        self.tool_calls: dict[Any, dict[str, Any]] = {}
        self.logprobs: list[Any] | None = None
        """Chat: the entries of ``logprobs.content``, once a chunk carried them."""
        self.text_logprobs: dict[str, list[Any]] | None = None
        """Completions: ``logprobs``' four lists, once a chunk carried them."""
        self.finish_reason: Any = None
        self.stop_reason: Any = None
        self.token_ids: list[Any] = []
        self.prompt_token_ids: Any = None

    def add_chat(self, choice: dict[str, Any]) -> None:
        delta = choice.get("delta")
        if type(delta) is dict:
            if delta.get("role") is not None:
                self.role = delta["role"]
            if content := delta.get("content"):
                self.content.append(content)
            for key in ("reasoning", "reasoning_content"):
                if reasoning := delta.get(key):
                    self.reasoning.append(reasoning)
                    self.reasoning_key = key
            for call in delta.get("tool_calls") or ():
                self._tool_call(call)
        logprobs = choice.get("logprobs")
        if type(logprobs) is dict:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(logprobs.get("content") or ())
        self._add(choice)

    def add_text(self, choice: dict[str, Any]) -> None:
        if text := choice.get("text"):
            self.content.append(text)
        logprobs = choice.get("logprobs")
        if type(logprobs) is dict:
            if self.text_logprobs is None:
                self.text_logprobs = {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
            for name, entries in self.text_logprobs.items():
                entries.extend(logprobs.get(name) or ())
        if choice.get("prompt_token_ids") is not None:
            self.prompt_token_ids = choice["prompt_token_ids"]
        self._add(choice)

    def _add(self, choice: dict[str, Any]) -> None:
        if type(ids := choice.get("token_ids")) is list:
            self.token_ids.extend(ids)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
            self.stop_reason = choice.get("stop_reason")

    def _tool_call(self, call: Any) -> None:
        """A tool call's deltas, merged as the openai SDK merges a streamed one: by index,
        the name and id once, the arguments concatenated."""
        if type(call) is not dict:
            return
        merged = self.tool_calls.setdefault(call.get("index", len(self.tool_calls)), {"function": {}})
        for key in ("id", "type"):
            if call.get(key) is not None:
                merged[key] = call[key]
        function = call.get("function")
        if type(function) is dict:
            if function.get("name") is not None:
                merged["function"]["name"] = function["name"]
            if function.get("arguments"):
                merged["function"]["arguments"] = merged["function"].get("arguments", "") + function["arguments"]

    def message(self) -> dict[str, Any]:
        reasoning = "".join(self.reasoning) or None
        tool_calls = [
            {
                "id": call.get("id"),
                "type": call.get("type", "function"),
                "function": {"name": call["function"].get("name"), "arguments": call["function"].get("arguments", "")},
            }
            for call in self.tool_calls.values()
        ]
        content: str | None = "".join(self.content)
        if not content and (reasoning is not None or tool_calls):
            content = None  # as vLLM's parsers leave it when the answer is all reasoning or tool calls
        message: dict[str, Any] = {
            "role": self.role or "assistant",
            "content": content,
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
        }
        if tool_calls:
            message["tool_calls"] = tool_calls
        message["reasoning"] = reasoning
        if self.reasoning_key != "reasoning":
            message[self.reasoning_key] = reasoning  # the name older servers stream it under
        return message


class Assembler:
    """A non-streamed call's JSON body, made of the events its decode leg streamed.

    Fed the events the caller would have had (``Tracker``'s output: ids stripped unless the
    caller asked for them, a continuation spliced in), it builds the body vLLM answers a
    non-streamed call with, field for field as vLLM 0.32 writes it: each choice's whole
    ``message`` (role, content, reasoning, tool calls) or ``text``, its ``logprobs`` entries
    in order, ``finish_reason`` and ``stop_reason``, the usage event's ``usage``, and
    ``token_ids`` / ``prompt_token_ids`` only when the caller asked for them.
    """

    __slots__ = (
        "_choices",
        "_framer",
        "_header",
        "_metrics",
        "_prompt_ids",
        "_usage",
        "chat",
        "fingerprint",
        "keep_ids",
    )

    def __init__(self, *, chat: bool, keep_ids: bool) -> None:
        self.chat = chat
        self.keep_ids = keep_ids
        self.fingerprint: Any = None
        self._framer = SSEFramer()
        self._header: tuple[Any, Any, Any] | None = None
        self._choices: dict[int, _Choice] = {}
        self._usage: dict[str, Any] | None = None
        self._metrics: Any = None
        self._prompt_ids: Any = None

    def feed(self, data: bytes) -> None:
        """Whole SSE events (a partial one waits for its end); raises ``CannotAssemble``."""
        for event in self._framer.feed(data):
            self._event(event_data(event))

    def body(self, usage: dict[str, int] | None = None) -> bytes:
        """The JSON body; ``usage`` stands in when no usage event came (a stream cut after its end)."""
        if rest := self._framer.rest().strip():
            self._event(event_data(rest))
        if self._header is None:
            raise CannotAssemble("the decode's stream ended before its first event")
        if not self._choices:
            raise CannotAssemble("the decode's stream carried no choice")
        event_id, created, model = self._header
        final = dict(self._usage if self._usage is not None else usage or {}) or None
        if final is not None:
            # The usage event leaves out what is None; a non-streamed body writes every field.
            final.setdefault("prompt_tokens_details", None)
            final.setdefault("completion_tokens_details", None)
        choices = [self._choice_body(index, c) for index, c in sorted(self._choices.items())]
        ids = self._prompt_ids if self.keep_ids else None
        answer: dict[str, Any] = {"id": event_id, "object": "chat.completion" if self.chat else "text_completion"}
        answer.update(created=created, model=model, choices=choices, service_tier=None)
        answer.update(system_fingerprint=self.fingerprint, usage=final)
        if self.chat:
            answer.update(prompt_logprobs=None, prompt_token_ids=ids, prompt_text=None)
        answer.update(kv_transfer_params=None, ec_transfer_params=None, metrics=self._metrics)
        return orjson.dumps(answer)

    def _choice_body(self, index: int, choice: _Choice) -> dict[str, Any]:
        token_ids = choice.token_ids if self.keep_ids else None
        if self.chat:
            logprobs = None if choice.logprobs is None else {"content": choice.logprobs}
            return {
                "index": index,
                "message": choice.message(),
                "logprobs": logprobs,
                "finish_reason": choice.finish_reason,
                "stop_reason": choice.stop_reason,
                "token_ids": token_ids,
                "routed_experts": None,
            }
        return {
            "index": index,
            "text": "".join(choice.content),
            "logprobs": choice.text_logprobs,
            "finish_reason": choice.finish_reason,
            "stop_reason": choice.stop_reason,
            "token_ids": token_ids,
            "prompt_logprobs": None,
            "prompt_token_ids": choice.prompt_token_ids if self.keep_ids else None,
            "routed_experts": None,
        }

    def _event(self, payload: bytes | None) -> None:
        if payload is None or is_done(payload):
            return  # a comment (a keep-alive), a field vLLM does not send, the stream's end
        try:
            obj = orjson.loads(payload)
        except orjson.JSONDecodeError:
            raise CannotAssemble("the decode sent an event that is not JSON") from None
        if type(obj) is not dict:
            raise CannotAssemble("the decode sent an event that is not a JSON object")
        if "error" in obj:
            error = obj["error"]
            message = error.get("message") if type(error) is dict else error
            raise CannotAssemble(f"the decode reported an error in its stream: {message}")
        if self._header is None:
            self._header = (obj.get("id"), obj.get("created"), obj.get("model"))
        if obj.get("system_fingerprint") is not None:
            self.fingerprint = obj["system_fingerprint"]
        if type(usage := obj.get("usage")) is dict:
            self._usage = usage
            self._metrics = obj.get("metrics", self._metrics)
        if self.chat and obj.get("prompt_token_ids") is not None:
            self._prompt_ids = obj["prompt_token_ids"]
        choices = obj.get("choices")
        if type(choices) is not list:
            return
        for choice in choices:
            if type(choice) is not dict:
                continue
            index = choice.get("index", 0)
            state = self._choices.get(index) if type(index) is int else None
            if state is None:
                if type(index) is not int:
                    raise CannotAssemble(f"the decode sent a choice whose index is {index!r}")
                state = self._choices[index] = _Choice()
            if self.chat:
                state.add_chat(choice)
            else:
                state.add_text(choice)
