"""A decode-only call's warm-up in slices (``fleet._warm``): the prefill server's /tokenize
of the call's messages, then one-token completions of ever longer prefixes of those ids.

Each slice computes about ``ConversationSettings.warm_up_slice_ms`` of new tokens (at the
learnt milliseconds per prompt token, ``CostModel.ms_per_prompt_token``) on the blocks the
slice before left cached, so a caller's prefill arriving on that server waits for one
slice, not the whole warm-up. The ids are exactly the prompt the chat endpoint renders
(``forwardable``), and a completion of ids with the same model and cache salt leaves the
same cached blocks as the chat call would: the next P/D turn finds them.

Sliced only where it helps: a chat call whose uncached tokens come to two slices or more
(a GPU's ~0.05 ms a token makes a slice ~10,000 tokens). A tokenize that fails leaves the
warm-up as one request, as before.
"""

from __future__ import annotations

from .. import wire
from ..fleet import Fetch, Slicer
from ..pools import Endpoint
from ._leg_requests import LegRequests
from ._prompt_ids import forwardable, tokenized_ids


def slice_tokens(slice_ms: float | None, ms_per_token: float, block_size: int) -> int | None:
    """The tokens a slice computes: what the prefill computes in about ``slice_ms`` at
    ``ms_per_token``, in whole blocks, one at least; None when not sliced (no budget, or no
    learnt rate)."""
    if slice_ms is None or ms_per_token <= 0:
        return None
    return max(1, int(slice_ms / ms_per_token) // block_size) * block_size


def slice_ends(count: int, uncached: int, size: int, block_size: int) -> list[int]:
    """Where a prompt of ``count`` ids is cut: from the block the server is estimated to hold
    up to (``uncached`` tokens from the end), every ``size`` tokens, the last at its end."""
    start = max(0, count - uncached) // block_size * block_size
    return [*range(start + size, count, size), count]


def sliced_warm_up(
    plan: wire.Plan, requests: LegRequests, endpoint: Endpoint, uncached: int, size: int | None, block_size: int
) -> tuple[Fetch, Slicer] | None:
    """The tokenize that starts a sliced warm-up on ``endpoint``, and what makes its slices
    from the answer; None when the call is not sliced (``size`` None, fewer uncached tokens
    than two slices, or not a chat call whose ids are its prompt)."""
    if size is None or uncached < 2 * size or not forwardable(plan):
        return None

    def slices(answer: str) -> tuple[Fetch, ...]:
        ids = tokenized_ids(answer)
        if ids is None:
            return ()
        ends = slice_ends(len(ids), uncached, size, block_size)
        return tuple(
            requests.warm_up_slice(endpoint, wire.warm_up_slice_body(plan, ids[:end]), n) for n, end in enumerate(ends)
        )

    return requests.warm_up_tokenize(endpoint, plan), slices


__all__ = ["slice_ends", "slice_tokens", "sliced_warm_up"]
