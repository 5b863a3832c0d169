"""Template-drift check: re-render a sample of reused prompts off the critical path.

Seam note
---------
Why: reused ids are only right if prefill and decode render the same prompt. Different
  chat templates, tokenizers, system-prompt injection or vLLM versions on the two
  sides make decode continue a prompt the user did not send, silently. With
  ``PDCLIENT_REUSE_VERIFY_RATE=r`` (0..1) the decode server renders and tokenizes a
  share ``r`` of the requests that reused ids, in a background task after the request
  has been handed on, and compares.
Upstream: none (vLLM has no such check); it wraps the same ``preprocess_chat`` seam as
  the reuse patch, on every supported version.
When to remove: when you no longer run prefill and decode from separately deployed
  configurations, or when vLLM grows an equivalent check.

A mismatch is logged as a WARNING with the request id and counted in
``pdclient_reuse_verify_mismatch_total`` on vLLM's /metrics
(``pdclient_reuse_verify_checked_total`` counts completed checks).
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import random
from typing import Any

logger = logging.getLogger("vllm.plugins.pdclient_reuse")

# X-Request-Id of the HTTP request being served, set by the ASGI middleware (_guard.py).
REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("pdclient_request_id", default=None)

# Background checks in flight: asyncio keeps only weak references to tasks.
_tasks: set[asyncio.Task[None]] = set()
_metrics: dict[str, Any] = {}


def metrics() -> dict[str, Any]:
    """Prometheus counters, created once per process on first use.

    vLLM serves prometheus_client's default registry on /metrics (or the multiprocess
    collector when it runs several API servers, which counters created here also
    feed), so no vLLM API is needed to publish them.
    """
    if not _metrics:
        from prometheus_client import Counter

        _metrics["checked"] = Counter(
            "pdclient_reuse_verify_checked", "Reused prompts re-rendered by the pdclient drift check."
        )
        _metrics["mismatch"] = Counter(
            "pdclient_reuse_verify_mismatch",
            "Reused prompts whose forwarded ids differ from this server's own rendering.",
        )
        _metrics["rejected"] = Counter(
            "pdclient_reuse_guard_rejected", "Requests rejected (403) for unsigned or mis-signed kv_transfer_params."
        )
    return _metrics


def wrap_preprocess_chat(original: Any, rate: float) -> Any:
    """Wrap ``preprocess_chat`` (native or already patched for reuse) with the sampler."""

    @functools.wraps(original)
    async def preprocess_chat(self: Any, request: Any, messages: Any, *args: Any, **kwargs: Any) -> Any:
        kv = getattr(request, "kv_transfer_params", None)
        forwarded = kv.get("prompt_token_ids") if isinstance(kv, dict) else None
        if not isinstance(forwarded, list) or random.random() >= rate:
            return await original(self, request, messages, *args, **kwargs)
        # Snapshot before the call: the render must see the request as the client sent
        # it, not after the parsers' adjust_request. A shallow copy is enough.
        snapshot = request.model_copy(update={"kv_transfer_params": None})
        result = await original(self, request, messages, *args, **kwargs)
        _, engine_inputs = result
        if engine_inputs[0].get("prompt_token_ids") == forwarded:  # the ids were used
            task = asyncio.get_running_loop().create_task(
                _check(original, self, snapshot, messages, args, kwargs, forwarded)
            )
            _tasks.add(task)
            task.add_done_callback(_tasks.discard)
        return result

    preprocess_chat.__pdclient_wrapped__ = True  # type: ignore[attr-defined]
    return preprocess_chat


async def _check(
    preprocess_chat: Any, renderer: Any, request: Any, messages: Any, args: Any, kwargs: Any, ids: list[int]
) -> None:
    request_id = REQUEST_ID.get() or getattr(request, "request_id", None)
    # No parser: adjust_request only shapes sampling, not the prompt, and must not run twice.
    kwargs = {k: (None if k in ("parser", "tool_parser", "reasoning_parser") else v) for k, v in kwargs.items()}
    try:
        await asyncio.sleep(0)  # let the request itself go on to the engine first
        _, engine_inputs = await preprocess_chat(renderer, request, messages, *args, **kwargs)
        rendered = list(engine_inputs[0]["prompt_token_ids"])
    except Exception as exc:  # a failed check must never affect serving
        logger.warning("pdclient_reuse: drift check for request %s failed: %r", request_id, exc)
        return
    counters = metrics()
    counters["checked"].inc()
    if rendered != ids:
        counters["mismatch"].inc()
        at = next(
            (i for i, (a, b) in enumerate(zip(ids, rendered, strict=False)) if a != b), min(len(ids), len(rendered))
        )
        logger.warning(
            "pdclient_reuse: request %s: forwarded prompt_token_ids differ from this server's rendering "
            "(forwarded %d tokens, rendered %d, first difference at index %d): prefill and decode use "
            "different chat templates, tokenizers or vLLM versions",
            request_id,
            len(ids),
            len(rendered),
            at,
        )
