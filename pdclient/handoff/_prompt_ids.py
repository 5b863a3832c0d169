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

When the call then goes decode-only, its decode leg takes those ids as a handoff's takes
the prefill's (``kv_transfer_params.prompt_token_ids``, signed alike), so the decode
server neither renders nor tokenizes the messages again; only when the ids are what its
chat endpoint would render (``forwardable``), else the leg goes with its messages alone.
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
UNRENDERED_FIELDS = ("documents", "reasoning_effort", "truncate_prompt_tokens", "mm_processor_kwargs")
"""Chat fields that can change the prompt vLLM's chat endpoint renders and that its
/tokenize does not read (vLLM 0.32's tokenize request has no such fields, ``documents``
included, though it is sent): templates read ``documents`` and ``reasoning_effort``, chat
cuts a prompt to ``truncate_prompt_tokens``. With any of them set, the ids are not forwarded."""
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


def forwardable(plan: wire.Plan) -> bool:
    """Whether a /tokenize's ids of ``plan``'s messages are exactly the prompt the decode
    server's chat endpoint would render, as the handoff assumes of a prefill's: a chat call
    whose ids a handoff would forward (not ``ids_skipped``: media, ``echo``, ids turned
    off), with nothing /tokenize does not render (``UNRENDERED_FIELDS``; a ``tool_choice``
    other than ``auto`` beside tools, which some templates read and vLLM may drop the tools
    for; a ``response_format`` other than text, which some renderers read)."""
    if plan.kind is not wire.Kind.CHAT or plan.ids_skipped is not None:
        return False
    try:
        if any(wire.field_value(plan.fields, name) is not None for name in UNRENDERED_FIELDS):
            return False
        tools, choice = wire.field_value(plan.fields, "tools"), wire.field_value(plan.fields, "tool_choice")
        response_format = wire.field_value(plan.fields, "response_format")
    except wire.Refusal:
        return False
    if tools and choice not in (None, "auto"):
        return False
    return response_format is None or response_format == {"type": "text"}


def prompt_ids(response: httpx.Response) -> list[int] | None:
    """The ids of a /tokenize answer (``{"count": n, "tokens": [...]}``); None for anything
    else, or ids that are not as many as its own count says."""
    if response.status_code != 200:
        return None
    try:
        answer = orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None
    tokens = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(tokens, list) or not tokens or not all(type(token) is int and token >= 0 for token in tokens):
        return None
    count = answer.get("count", len(tokens))
    return tokens if count == len(tokens) else None
