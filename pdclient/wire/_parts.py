"""Which content parts of a chat message are text: one rule, vLLM's.

vLLM renders a part whose type is one of ``TEXT_PART_TYPES`` (a missing type reads as
``text``) as text, unless it carries a multimodal key; anything else is media, which only
the server's processor can turn into tokens. The rule decides whether the prefill's ids
may be forwarded (media: the decode renders the prompt itself), whether a conversation's
new turn adds media (a handoff), and what a prompt's text is for cache-aware routing.
The server patch applies the same rule on the server (it imports nothing of pdclient);
tests/unit/test_content_parts.py holds both to one table of cases.
"""

from __future__ import annotations

from typing import Any

TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})
"""vLLM 0.32's ``TEXT_PART_TYPES`` and ``tool_reference``, which carries no media either."""
MEDIA_PART_KEYS = frozenset(
    {"image_url", "audio_url", "video_url", "input_audio", "input_image", "image_pil"}
    | {"image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "file"}
)
"""Keys that make a part multimodal whatever its type (vLLM's parser map)."""


def is_text_part(part: object) -> bool:
    """Whether vLLM renders this content part as text. A part that is neither a string nor
    an object is not text: unsure counts as media, whose handling is always correct."""
    if isinstance(part, str):
        return True
    if not isinstance(part, dict):
        return False
    return not part.keys() & MEDIA_PART_KEYS and part.get("type", "text") in TEXT_PART_TYPES


def has_media(messages: Any) -> bool:
    """Whether any message's content has a part that is not text."""
    if not isinstance(messages, list):
        return False
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and not all(is_text_part(part) for part in content):
            return True
    return False
