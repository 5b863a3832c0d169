"""What the memory keeps of a conversation instead of its text: digests of its messages, its
shape and its answer, and the lengths of the text a template renders."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import orjson

from ..wire import has_media

# Request fields besides the messages that change the rendered prompt (or may, depending on
# the server's flags): a call whose value differs from the previous turn's starts afresh.
SHAPE_FIELDS = (
    "model",
    "tools",
    "functions",
    "tool_choice",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "add_special_tokens",
)
"""The request fields besides ``messages`` that ``ConversationMemory`` reads of a call."""
# Keys of an assistant message that may carry the streamed answer; any other key with a
# value may be rendered by the template, and the message is then not taken as the answer.
_ANSWER_KEYS = frozenset({"role", "content", "tool_calls"})
_TEMPLATE_FIELDS = frozenset(
    {"role", "content", "tool_calls", "reasoning", "reasoning_content", "name", "tool_call_id", "task", "tools"}
)
"""The message fields vLLM hands the chat template (0.32: ``renderers/chat_utils.py``,
``_parse_chat_message_content``; ``reasoning_content`` before ``reasoning``); a message's
other fields are dropped unrendered."""
# A one-part content of these types is the same message as its text as a plain string
# (how an answer comes back and how the caller may send it again); a narrower question
# than whether a part is text at all (``wire.is_text_part``).
_STRING_EQUIVALENT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
DIGEST_SIZE = 16


def _encode(value: object) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS, default=str)


def messages_digest(messages: Sequence[object]) -> bytes:
    """One digest of a message list; equal lists (as JSON, keys sorted) give equal digests."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for message in messages:
        encoded = _encode(message)
        h.update(len(encoded).to_bytes(8, "little"))
        h.update(encoded)
    return h.digest()


def shape_digest(body: Mapping[str, Any]) -> bytes:
    return hashlib.blake2b(_encode([body.get(k) for k in SHAPE_FIELDS]), digest_size=DIGEST_SIZE).digest()


def _text_of(content: object) -> str | None:
    """A message content as the plain text it renders to, or None if it is not plain text."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and len(content) == 1 and isinstance(content[0], dict):
        part = content[0]
        if part.get("type") in _STRING_EQUIVALENT_PART_TYPES and isinstance(part.get("text"), str):
            return str(part["text"])
    return None


def adds_media(messages: Sequence[object]) -> bool:
    """Whether any of ``messages`` has a content part other than text (``wire.is_text_part``):
    something the server encodes itself, an image, audio, video, a file. Unsure is media: a
    handoff costs little more than a decode-only call, while an image on the decode server
    costs its whole encoding there."""
    return has_media(list(messages))


def answer_digest(content: str | None, tool_calls: Sequence[Mapping[str, Any]]) -> bytes:
    calls = []
    for call in tool_calls:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            with contextlib.suppress(orjson.JSONDecodeError):  # the server parses them before rendering
                arguments = orjson.loads(arguments)
        calls.append([call.get("id"), function.get("name"), arguments])
    return hashlib.blake2b(_encode([content, calls]), digest_size=DIGEST_SIZE).digest()


def as_answer_digest(message: object) -> bytes | None:
    """The digest of an assistant message that may be a streamed answer sent back, else None."""
    if not isinstance(message, dict) or message.get("role") != "assistant":
        return None
    if any(value is not None for key, value in message.items() if key not in _ANSWER_KEYS):
        return None
    content = message.get("content")
    text = None if content is None else _text_of(content)
    if content is not None and text is None:
        return None
    tool_calls = message.get("tool_calls") or []
    if not isinstance(tool_calls, list) or not all(isinstance(c, dict) for c in tool_calls):
        return None
    return answer_digest(text, tool_calls)


def rendered_chars(messages: Sequence[object], tools: object = None) -> int:
    """The length of the text a chat template renders from these messages and tools,
    without the template's own markup (counted per message by the settings).

    Only what the server hands the template counts (``_TEMPLATE_FIELDS``; of a tool call
    its id, type, name and arguments; of a tool its type and function): any other field
    of a message is dropped before rendering, and counting it would read a padded call
    as text the template never renders.
    """
    total = 0
    for message in messages:
        if not isinstance(message, dict):
            total += len(_encode(message))
            continue
        for key, value in message.items():
            if value is None or key not in _TEMPLATE_FIELDS:
                continue
            if key == "content":
                total += _content_chars(value)
            elif key == "tool_calls":
                total += len(_encode(_tool_calls_rendered(value)))
            elif isinstance(value, str):
                total += len(value)
            else:  # the template renders them as JSON or close to it
                total += len(_encode(value))
    if tools:
        total += len(_encode(_tools_rendered(tools)))
    return total


def _tool_calls_rendered(calls: object) -> object:
    if not isinstance(calls, list):
        return calls
    rendered: list[object] = []
    for call in calls:
        if not isinstance(call, dict):
            rendered.append(call)
            continue
        function = call.get("function")
        if isinstance(function, dict):
            function = {k: function[k] for k in ("name", "arguments") if k in function}
        rendered.append({k: function if k == "function" else call[k] for k in ("id", "type", "function") if k in call})
    return rendered


def _tools_rendered(tools: object) -> object:
    if not isinstance(tools, list):
        return tools
    return [
        {k: tool[k] for k in ("type", "function") if k in tool} if isinstance(tool, dict) else tool for tool in tools
    ]


def _content_chars(content: object) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        chars = 0
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                chars += len(part["text"])
            else:
                chars += len(_encode(part))
        return chars
    return len(_encode(content))


def reusable_answer_text(message: object) -> str | None:
    """An assistant message's text when it may be the answer as generated (plain text, no
    tool calls, nothing else the template renders), whose ids the next prompt starts with."""
    if as_answer_digest(message) is None:
        return None
    assert isinstance(message, dict)
    if message.get("tool_calls"):
        return None
    content = message.get("content")
    return None if content is None else _text_of(content)


def is_assistant(message: object) -> bool:
    return isinstance(message, dict) and message.get("role") == "assistant"


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode("utf-8", "surrogatepass"), digest_size=DIGEST_SIZE).digest()
