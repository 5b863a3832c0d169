"""Decode-side reuse of forwarded prompt ids on vLLM versions without it (0.20 - 0.26).

Seam note
---------
Why: in P/D disaggregation the prefill server has already rendered and tokenized the
  chat prompt; the router forwards those ids in ``kv_transfer_params["prompt_token_ids"]``.
  vLLM before 0.27 ignores them and renders + tokenizes again on decode, on the
  critical path (~100 ms at 32k tokens with a fast tokenizer).
Upstream: vllm-project/vllm#48145 ("Reuse prefill token ids on the decode chat path"),
  released in vLLM 0.27.0 as ``vllm/renderers/online_renderer.py::_reused_prompt_token_ids``.
  This module reproduces that behaviour: same key, same pop, same fall-through for
  ``echo`` and media, same 400 for malformed or out-of-vocabulary ids (plus one more:
  ids longer than the model's context).
When to remove: when the oldest vLLM you run is 0.27 or later; ``register()`` already
  skips this module there (it detects the native function, not a version number).

How (wrap and delegate, no vLLM code copied):
- ``<chat renderer>.preprocess_chat`` (``OnlineRenderer`` in 0.26,
  ``OpenAIServingRender`` in 0.20) is wrapped: it pops and validates the ids, then calls
  the real method with the ids in a context variable. Everything the real method does
  around rendering (``build_tok_params``, the reasoning/tool parsers' ``adjust_request``)
  still runs.
- ``BaseRenderer.render_chat_async`` is wrapped: when that context variable holds ids
  for a single conversation, it returns them as the engine input instead of applying
  the chat template and tokenizing - exactly what vLLM 0.27+ does.
- ``_make_request_with_harmony`` (gpt-oss) is wrapped the same way as vLLM 0.27+ does it.
The context variable is task-local, so concurrent requests never see each other's ids.
"""

from __future__ import annotations

import contextvars
import functools
import logging
from typing import Any

logger = logging.getLogger("vllm.plugins.pdclient_reuse")

PARAM = "kv_transfer_params.prompt_token_ids"

# Content-part types that carry text only (vLLM 0.32's TEXT_PART_TYPES + tool_reference).
# Anything else is treated as media and rendered as usual: falling through is always safe.
_TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text", "refusal", "thinking", "tool_reference"})
_MEDIA_PART_KEYS = frozenset(
    {"image_url", "audio_url", "video_url", "input_audio", "input_image", "image_pil"}
    | {"image_embeds", "audio_embeds", "video_embeds", "prompt_embeds", "file"}
)

# Ids for the render_chat_async call made by the current task's preprocess_chat.
_REUSE_IDS: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("pdclient_reuse_ids", default=None)


def has_media(messages: Any) -> bool:
    """Whether any message has a non-text content part (same rule as vLLM 0.32)."""
    if not isinstance(messages, list):
        return False
    for msg in messages:
        content = msg.get("content") if isinstance(msg, dict) else None
        if not isinstance(content, list):
            continue
        for part in content:
            if isinstance(part, dict) and (
                part.keys() & _MEDIA_PART_KEYS or part.get("type", "text") not in _TEXT_PART_TYPES
            ):
                return True
    return False


def pop_forwarded_ids(request: Any, renderer: Any, model_config: Any, messages: Any) -> list[int] | None:
    """Pop ``kv_transfer_params["prompt_token_ids"]``; return them if they are to be used.

    The contract of vLLM 0.32's ``_reused_prompt_token_ids``: the key is always removed
    (the list must not reach the engine's sampling metadata); ``None`` when absent, when
    ``echo`` is set or when messages hold media (those need a real render); otherwise the
    ids, or ``VLLMValidationError`` (HTTP 400 naming ``kv_transfer_params.prompt_token_ids``)
    for a malformed, out-of-vocabulary or longer-than-context list.
    """
    from vllm.exceptions import VLLMValidationError

    kv = getattr(request, "kv_transfer_params", None)
    if not isinstance(kv, dict):
        return None
    ids = kv.pop("prompt_token_ids", None)
    if ids is None or getattr(request, "echo", False) or has_media(messages):
        return None
    # bool is an int subclass, hence the exact type check.
    if not isinstance(ids, list) or not ids or any(type(x) is not int or x < 0 for x in ids):
        raise VLLMValidationError(
            "`kv_transfer_params['prompt_token_ids']` must be a non-empty list of non-negative integers.",
            parameter=PARAM,
        )
    tokenizer = getattr(renderer, "tokenizer", None)
    if tokenizer is not None:
        # Like vLLM's own check: the larger of the tokenizer's and the model's vocab.
        max_id = getattr(tokenizer, "max_token_id", None)
        if max_id is None:
            max_id = len(tokenizer) - 1
        limit = max(max_id, model_config.get_vocab_size() - 1)
        if (top := max(ids)) > limit:
            raise VLLMValidationError(f"Token id {top} is out of vocabulary", parameter=PARAM)
    # Rejected here rather than by the engine, which would only fail after a streamed
    # response has started.
    if len(ids) > model_config.max_model_len:
        raise VLLMValidationError(
            f"{len(ids)} forwarded prompt tokens exceed the model's context length ({model_config.max_model_len}).",
            parameter=PARAM,
        )
    return ids


def wrap_preprocess_chat(original: Any) -> Any:
    @functools.wraps(original)
    async def preprocess_chat(self: Any, request: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
        ids = pop_forwarded_ids(request, self.renderer, self.model_config, messages)
        if not ids:
            return await original(self, request, messages, *args, **kwargs)
        token = _REUSE_IDS.set(ids)
        try:
            result = await original(self, request, messages, *args, **kwargs)
        finally:
            _REUSE_IDS.reset(token)
        _, engine_inputs = result
        if engine_inputs[0].get("prompt_token_ids") is not ids:
            # The render_chat_async seam was not reached (a renderer subclass that
            # overrides it?). The prompt was rendered normally: correct, only slower.
            _warn_once("render_chat_async seam not reached; forwarded ids were not used")
        return result

    preprocess_chat.__pdclient_wrapped__ = True  # type: ignore[attr-defined]
    return preprocess_chat


def wrap_render_chat_async(original: Any, tokens_input: Any) -> Any:
    @functools.wraps(original)
    async def render_chat_async(self: Any, conversations: Any, *args: Any, **kwargs: Any) -> Any:
        ids = _REUSE_IDS.get()
        if ids is None or len(conversations) != 1:
            return await original(self, conversations, *args, **kwargs)
        _REUSE_IDS.set(None)  # one render per forwarded list
        extras = kwargs.get("prompt_extras") or {}
        # What vLLM 0.27+ builds for reused ids: no conversation, a plain token input.
        return [[]], [tokens_input(ids, cache_salt=extras.get("cache_salt"))]

    render_chat_async.__pdclient_wrapped__ = True  # type: ignore[attr-defined]
    return render_chat_async


def wrap_make_request_with_harmony(original: Any, tokens_input: Any) -> Any:
    @functools.wraps(original)
    def _make_request_with_harmony(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        # Harmony renders without a chat template and has no adjust_request tail, so
        # reused ids simply replace the render (as in vLLM 0.27+).
        ids = pop_forwarded_ids(request, self.renderer, self.model_config, None)
        if ids:
            return [], [tokens_input(ids, cache_salt=getattr(request, "cache_salt", None))]
        return original(self, request, *args, **kwargs)

    _make_request_with_harmony.__pdclient_wrapped__ = True  # type: ignore[attr-defined]
    return _make_request_with_harmony


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("pdclient_reuse: %s", message)
