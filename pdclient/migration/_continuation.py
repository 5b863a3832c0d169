"""A continuation of a cut decode stream: where its prompt is computed and its request bodies."""

from __future__ import annotations

import dataclasses
import enum

from .. import wire

REMOTE_PREFILL_MIN_TOKENS = 1024
"""A continuation whose prompt (the call's prompt plus the answer so far) has at least this
many tokens is computed by a prefill endpoint and handed over; a shorter one by the decode
endpoint itself. See ``continuation_route``."""


class Route(str, enum.Enum):
    """Where a continuation's prompt is computed."""

    DECODE = "decode"
    PREFILL_DECODE = "prefill+decode"


def continuation_route(prompt_tokens: int) -> Route:
    """Where to compute a continuation whose prompt has ``prompt_tokens`` tokens.

    Short: on the new decode endpoint itself. One request, no KV transfer and no NIXL
    handshake with a prefill server that endpoint may not have met yet; a short prefill
    delays the other streams on that server by about one step. Long: on a prefill
    endpoint, whose KV is handed over as for a new call, so a long prefill does not stall
    every stream of the decode server (the reason for P/D). Dynamo's conditional
    disaggregation makes the same cut ("if the prefill is short ... prefill locally in the
    decode engine").
    """
    return Route.PREFILL_DECODE if prompt_tokens >= REMOTE_PREFILL_MIN_TOKENS else Route.DECODE


@dataclasses.dataclass
class Continuation:
    """One continuation of a call: its request body (per route) and where it came from."""

    plan: wire.Plan
    """The caller's plan with the continuation's fields (budget reduced, ids asked for)."""
    ids: bytes
    """The continuation's prompt: the call's prompt ids and the kept ids, a JSON array."""
    count: int
    route: Route
    after_tokens: int
    from_url: str
    cause: str
    request_id: str
    to_url: str = ""
    result: wire.PrefillResult | None = None
    """The continuation's prefill answer (route prefill+decode), or the ids alone."""
    note: str | None = None
    """Why the route changed on the way (the prefill failed)."""

    def decode_body(self) -> bytes:
        result = self.result or wire.PrefillResult(self.ids, self.count, None)
        return wire.decode_body(self.plan, result)

    def prefill_body(self) -> bytes:
        return wire.prefill_body_for_ids(self.plan, self.ids)
