"""Prefill-side return of the prompt's ids in ``kv_transfer_params``, when the request asks for them.

Seam note
---------
Why: a router forwards the prefill's prompt ids to the decode
  (``kv_transfer_params["prompt_token_ids"]``, honoured by vLLM 0.27+ and by this plugin's
  reuse part before that), so the decode skips the chat template and the tokenizer. Chat
  and completions answers can carry the ids (``return_token_ids``); Responses
  (``/v1/responses``) and Anthropic Messages (``/v1/messages``) answers cannot, in any vLLM
  up to 0.32: the router had no ids to forward for them.
Upstream: none yet.
When to remove: when vLLM returns the prompt's ids on those routes itself.

How: a request whose ``kv_transfer_params`` hold ``"return_prompt_token_ids": true`` gets
``"prompt_token_ids"`` (the engine request's own ids: exactly what the engine ran, after
the chat template, the tokenizer and any adjustments) added to the ``kv_transfer_params``
its KV connector returns when the request finishes. The hook is the scheduler's
``Scheduler._connector_finished`` (same name and contract in vLLM 0.20 - 0.32), in the
engine-core process, below every route: whatever carries the connector's params out
(a chat or Messages answer's ``kv_transfer_params``, a Responses object's, the
``response.completed`` event of a Responses stream) carries the ids too. No connector, or
a connector that returns no params for this request (a plain server, a request that is
not a prefill for a remote decode): nothing is added and nothing fails. The flag itself
is a key the KV connectors ignore.
"""

from __future__ import annotations

import functools
from typing import Any

FLAG = "return_prompt_token_ids"
KEY = "prompt_token_ids"


def with_prompt_ids(request: Any, params: Any) -> Any:
    """``params`` (the connector's answer for ``request``) with the prompt's ids added if asked for."""
    if not isinstance(params, dict):
        return params
    asked = getattr(request, "kv_transfer_params", None)
    if not isinstance(asked, dict) or asked.get(FLAG) is not True:
        return params
    ids = getattr(request, "prompt_token_ids", None)
    if ids is None:  # prompt embeddings: there are no ids to give
        return params
    return {**params, KEY: list(ids)}  # a copy: the connector may keep its own dict


def wrap_connector_finished(original: Any) -> Any:
    @functools.wraps(original)
    def _connector_finished(self: Any, request: Any) -> Any:
        delay_free, params = original(self, request)
        return delay_free, with_prompt_ids(request, params)

    return _connector_finished
