"""What a dialect is: how one API's calls look on the wire for each leg of a P/D handoff.

The handoff (``handoff._call.Call``) asks the call's dialect for everything that differs
between APIs and never branches on the API itself: the plan read from the caller's body,
the prefill, warm-up, decode and release bodies, where the prefill's ids and KV
transfer parameters live in its answer, how the usage of both legs is merged, and
whether a broken decode stream may move.
"""

from __future__ import annotations

from typing import Protocol

from .. import wire


class Dialect(Protocol):
    """One API's bodies, ids, usage and stream end, as pure functions on bytes.

    A dialect subclasses this protocol and inherits the defaults of its optional hooks (an API
    with no server-stored state); the rest it must define."""

    kind: wire.Kind
    path: str
    """The route under the API's base URL (``/chat/completions``, ``/responses``, ...)."""
    migration_refusal: str | None
    """Why a decode stream of this API never moves to another endpoint (None: it may,
    under ``migration._arming``'s own rules)."""

    def plan(self, content: bytes, tenant: str | None) -> wire.Plan:
        """Read the caller's body; raises ``wire.Refusal`` for a request that cannot be split.
        ``Plan.messages`` is the conversation as chat messages, when the API has one."""
        ...

    def stored_state(self, plan: wire.Plan) -> str | None:
        """The field naming state a server stored (a previous response, a conversation), if the
        call refers to any: such a call runs decode-only, where that state is; the prefill
        server never has it."""
        return None

    tags_answer_ids: bool = False
    """Whether its answers carry ids a later call names as stored state: they get their decode
    endpoint's tag on the way out (``_stored_state``)."""

    def stored_at(self, plan: wire.Plan) -> str | None:
        """The decode endpoint's tag the call's stored-state id carries, if any, taken off the
        plan's field in place: the server gets its own id."""
        return None

    def prefill_body(self, plan: wire.Plan) -> bytes: ...

    def warm_up_body(self, plan: wire.Plan) -> bytes: ...

    def read_prefill(self, content: bytes) -> wire.PrefillResult: ...

    def decode_body(self, plan: wire.Plan, prefill: wire.PrefillResult | None) -> bytes: ...

    def release_body(self, plan: wire.Plan, prefill: wire.PrefillResult) -> bytes: ...

    def usage_merge(self, prefill: wire.PrefillResult, content_type: str) -> wire.UsageMerge | None:
        """How a disaggregated call's 200 decode body gets the prefill's input side of the usage."""
        ...


def merge_for(
    prefill: dict[str, object] | None, content_type: str, merge: wire.PayloadMerge = wire.merge_chat_payload
) -> wire.UsageMerge | None:
    """A ``UsageMerge`` for a decode body of this content type (SSE or JSON), or None."""
    if prefill is None:
        return None
    if content_type.startswith("text/event-stream"):
        return wire.UsageMerge(prefill, stream=True, merge=merge)
    if content_type.startswith("application/json"):
        return wire.UsageMerge(prefill, stream=False, merge=merge)
    return None
