"""A chat call's prompt ids from a prefill server's ``POST /tokenize``, asked before ``auto``
decides a call whose history no one here saw answered (another process's turns, a made-up
few-shot history): with them the decode endpoint's KV events say exactly how much of the
prompt it holds (``ConversationMemory.with_prompt_ids``), where the call's word alone could
only be trusted up to ``unseen_history_tokens``.

Why the prefill server: vLLM renders and tokenizes chat ``messages`` there as its chat
endpoint does (the same template, tools and options), so the ids are the ones a handoff's
prefill would compute; its API process tokenizes without waiting for its engine's steps,
and the decode server, whose steps the other streams wait on, is never asked. Asked only
when the decode's events are current and the prompt could hold a block of history
(``wants_prompt_ids``), under a short timeout; a failure of any kind leaves the estimate
to decide, as before. Its time is the call's ``PDTrace.tokenize_ms``.
"""

from __future__ import annotations

from typing import Any

import httpx
import orjson

from .. import wire
from ..fleet import server_url

TOKENIZE_PATH = "/tokenize"
TOKENIZE_TIMEOUT_S = 1.0
"""A tokenize answers in milliseconds (docs/conversations.md); a server slower than this is
busy enough that the estimate should decide without it."""
TOKENIZE_FIELDS = (
    "model",
    "tools",
    "chat_template",
    "chat_template_kwargs",
    "add_generation_prompt",
    "continue_final_message",
    "documents",
    "add_special_tokens",
)
"""The chat fields besides ``messages`` that vLLM's /tokenize renders a prompt with, as its
chat endpoint does (all read when the call was planned: readable)."""
_FORWARDED_HEADERS = frozenset({b"authorization", b"api-key", b"x-api-key"})


def tokenize_request(plan: wire.Plan, prefill_base: str, caller: httpx.Request, request_id: str) -> httpx.Request:
    """The ``POST /tokenize`` of the call's messages on the prefill server at ``prefill_base``
    (an OpenAI base URL: /tokenize is at its root, beside /v1), with the caller's key."""
    body: dict[str, Any] = {"messages": plan.messages}
    for name in TOKENIZE_FIELDS:
        value = wire.field_value(plan.fields, name)
        if value is not None:
            body[name] = value
    headers = [(k, v) for k, v in caller.headers.raw if k.lower() in _FORWARDED_HEADERS]
    headers += [(b"content-type", b"application/json"), (b"x-request-id", request_id.encode("ascii"))]
    return httpx.Request(
        "POST",
        server_url(prefill_base, TOKENIZE_PATH),
        headers=headers,
        content=orjson.dumps(body),
        extensions={"timeout": dict.fromkeys(("connect", "read", "write", "pool"), TOKENIZE_TIMEOUT_S)},
    )


def prompt_ids(response: httpx.Response) -> list[int] | None:
    """The ids of a /tokenize answer (``{"count": n, "tokens": [...]}``); None for anything else."""
    if response.status_code != 200:
        return None
    try:
        answer = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not tokens or not all(type(token) is int for token in tokens):
        return None
    return tokens
