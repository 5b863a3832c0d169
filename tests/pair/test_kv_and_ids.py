"""The handoff is real: the KV moved over NIXL, and decode used the forwarded ids."""

from __future__ import annotations

from typing import Any

import openai

from pdclient import PDTrace
from pdclient.local import PDServers

from .helpers import GREEDY, chat_text, metric, user


def test_kv_cache_moved_over_nixl(pd: PDServers, plain: openai.OpenAI) -> None:
    # vLLM's NIXL connector observes each transfer on the decode side (nixl/stats.py), and
    # the scheduler counts prompt tokens by where their KV came from.
    question = "Explain in one sentence what a KV cache is in a transformer."
    before_xfers = metric(pd.decode_url, "vllm:nixl_xfer_time_seconds_count")
    before_bytes = metric(pd.decode_url, "vllm:nixl_bytes_transferred_sum")
    before_external = metric(pd.decode_url, "vllm:external_prefix_cache_hits_total")
    traces: list[PDTrace] = []
    with pd.client(on_trace=traces.append) as client:
        client.chat.completions.create(model=pd.model, messages=user(question), **GREEDY)
    forwarded = traces[-1].forwarded_tokens
    assert forwarded > 0 and traces[-1].fallback is None
    assert metric(pd.decode_url, "vllm:nixl_xfer_time_seconds_count") == before_xfers + 1
    # ~22.5 KiB of bf16 KV per token for SmolLM2-135M (30 layers x 3 KV heads x 64 x 2 x 2 B).
    assert metric(pd.decode_url, "vllm:nixl_bytes_transferred_sum") - before_bytes >= 20_000 * (forwarded // 2)
    assert metric(pd.decode_url, "vllm:external_prefix_cache_hits_total") > before_external


def _prefill_ids(pd: PDServers, question: str) -> list[int]:
    with openai.OpenAI(base_url=pd.prefill_url, api_key="EMPTY", max_retries=0) as prefill:
        raw = prefill.chat.completions.with_raw_response.create(
            model=pd.model, messages=user(question), max_tokens=1, extra_body={"return_token_ids": True}
        )
    body: dict[str, Any] = raw.http_response.json()
    ids: list[int] = body["prompt_token_ids"]
    return ids


def test_decode_follows_forwarded_ids_not_messages(pd: PDServers, plain: openai.OpenAI) -> None:
    """The forwarded-ids probe: decode gets messages B but the ids of prompt A; A's answer returns."""
    question_a = "What is the capital of Italy?"
    question_b = "List two kinds of fruit."
    answer_a = chat_text(plain, pd.model, question_a)
    ids_a = _prefill_ids(pd, question_a)
    assert ids_a != _prefill_ids(pd, question_b)
    forwarded = {"kv_transfer_params": {"prompt_token_ids": ids_a}, "return_token_ids": True}
    raw = plain.chat.completions.with_raw_response.create(
        model=pd.model, messages=user(question_b), **GREEDY, extra_body=forwarded
    )
    # The engine ran A's ids (the answer echoes them) and so gave A's answer, whatever it says
    # on this CPU; the two answers' texts may even agree, the prompts' ids cannot.
    assert raw.http_response.json()["prompt_token_ids"] == ids_a
    assert raw.parse().choices[0].message.content == answer_a
