"""A long warm-up's slices: their size from the learnt rate, where the prompt is cut, their bodies."""

from __future__ import annotations

import json

import pytest

from pdclient import wire
from pdclient.handoff._warm_up_slices import slice_ends, slice_tokens


@pytest.mark.parametrize(
    ("slice_ms", "ms_per_token", "tokens"),
    [
        (500.0, 2.0, 128),  # 250 tokens: whole blocks only
        (500.0, 1.0, 384),
        (500.0, 50.0, 128),  # a block at least, however slow
        (500.0, 0.05, 9984),  # a GPU: 10,000 tokens, so a warm-up is rarely sliced
        (None, 2.0, None),  # turned off
        (500.0, 0.0, None),  # no rate learnt yet (the handoff prior has none)
    ],
)
def test_a_slice_is_what_the_prefill_computes_in_about_the_budget(
    slice_ms: float | None, ms_per_token: float, tokens: int | None
) -> None:
    assert slice_tokens(slice_ms, ms_per_token, 128) == tokens


def test_slices_start_at_the_block_the_server_holds_and_end_at_the_prompt_s_end() -> None:
    # 1,700 ids, ~1,040 uncached: the server holds 660 of them, 5 whole blocks (640).
    assert slice_ends(1700, 1040, 256, 128) == [896, 1152, 1408, 1664, 1700]
    assert slice_ends(1700, 5000, 512, 128) == [512, 1024, 1536, 1700]  # more uncached than the prompt
    assert slice_ends(1024, 512, 256, 128) == [768, 1024]  # the last slice ends on a block


def test_a_slice_is_a_one_token_completion_of_ids_keyed_as_the_chat_call() -> None:
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "tenant-a", "temperature": 0.3}
    ).encode()
    plan = wire.plan_call(wire.Kind.CHAT, body, None)
    assert json.loads(wire.warm_up_slice_body(plan, [1, 2, 3])) == {
        "prompt": [1, 2, 3],
        "max_tokens": 1,
        "stream": False,
        "model": "m",
        "cache_salt": "tenant-a",
    }
