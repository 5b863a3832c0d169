"""Chat completions and completions: the dialects vLLM's P/D contract was written for.

Their bodies, ids and usage are the wire contract itself (``wire._bodies``,
``wire._usage``), which decode migration builds its continuations from too; these
dialects name them for the handoff.
"""

from __future__ import annotations

from typing import Any

import orjson

from .. import wire
from ._dialect import Dialect, merge_for


class _Classic(Dialect):
    """Chat completions or completions (``kind`` says which)."""

    migration_refusal: str | None = None

    def __init__(self, kind: wire.Kind, path: str) -> None:
        self.kind = kind
        self.path = path

    def plan(self, content: bytes, tenant: str | None) -> wire.Plan:
        return wire.plan_call(self.kind, content, tenant)

    def prefill_body(self, plan: wire.Plan) -> bytes:
        return wire.prefill_body(plan)

    def warm_up_body(self, plan: wire.Plan) -> bytes:
        return wire.warm_up_body(plan)

    def read_prefill(self, content: bytes) -> wire.PrefillResult:
        return wire.read_prefill(self.kind, content)

    def decode_body(self, plan: wire.Plan, prefill: wire.PrefillResult | None) -> bytes:
        return wire.decode_body(plan, prefill)

    def release_body(self, plan: wire.Plan, prefill: wire.PrefillResult) -> bytes:
        return wire.release_body(plan, prefill)

    def usage_merge(self, prefill: wire.PrefillResult, content_type: str) -> wire.UsageMerge | None:
        # The prompt count is the ids' (checked against the prefill's own usage).
        if prefill.ids is None:
            return None
        side: dict[str, Any] = {"prompt_tokens": prefill.count}
        if prefill.prompt_tokens_details is not None:
            side["prompt_tokens_details"] = orjson.loads(prefill.prompt_tokens_details)
        return merge_for(side, content_type)


CHAT = _Classic(wire.Kind.CHAT, "/chat/completions")
COMPLETIONS = _Classic(wire.Kind.COMPLETIONS, "/completions")
