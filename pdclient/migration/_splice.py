"""A continuation's events rewritten into the caller's stream: the original header, no second
role chunk, one usage for the whole answer."""

from __future__ import annotations

from typing import Any

import orjson


class Splice:
    """Rewrites a continuation's events into the caller's stream."""

    __slots__ = ("base", "chat", "first", "header", "keep_ids", "prompt_tokens")

    def __init__(
        self, header: tuple[Any, Any, Any] | None, prompt_tokens: int, base: int, chat: bool, keep_ids: bool
    ) -> None:
        self.header = header
        self.prompt_tokens = prompt_tokens
        self.base = base
        """Generated tokens the caller had when this continuation began (in its prompt)."""
        self.chat = chat
        self.keep_ids = keep_ids
        self.first = True

    def rewrite(self, obj: dict[str, Any], choice: dict[str, Any] | None, delta: Any) -> bytes:
        if self.first and choice is not None:
            self.first = False
            if self.chat and delta and "role" in delta and not delta.get("content") and not choice.get("token_ids"):
                return b""  # the caller had its role chunk from the first server
        if self.header is not None:
            obj["id"], obj["created"], obj["model"] = self.header
        obj.pop("prompt_token_ids", None)
        if choice is not None:
            choice.pop("prompt_token_ids", None)
            if not self.keep_ids:
                choice.pop("token_ids", None)
        usage = obj.get("usage")
        if type(usage) is dict:
            generated = usage.get("completion_tokens")
            usage["prompt_tokens"] = self.prompt_tokens
            if isinstance(generated, int):
                usage["completion_tokens"] = self.base + generated
                usage["total_tokens"] = self.prompt_tokens + self.base + generated
            usage.pop("prompt_tokens_details", None)  # the continuation's prompt, not the caller's
        return b"data: " + orjson.dumps(obj) + b"\n\n"
