"""The premise of decode-only follow-ups, kept by a test: after a P/D turn, the decode server holds the next turn.

The next turn of a conversation resends the previous messages, the answer the decode
server streamed, and a short new message. Sent decode-only to that decode server, its
prefix cache answers all of it but the new message and the partial last block: the
previous prompt (whose KV it pulled over NIXL), and the answer's ids but the last one
(sampled, never computed), as far as the chat template re-renders the answer to the ids
that were generated: mostly all of it, but a model may generate a split the tokenizer
would not make (two "\n" where it reads one "\n\n"), and from there the new prompt's
ids differ. Sent through a second handoff instead, the prefill server holds only the
previous prompt, and the decode server pulls only the blocks it lacks.

Written against the wire contract (plain HTTP), so it checks the servers, not pdclient:
``pdclient/conversations/_memory.py`` counts cached tokens the way these tests measure them.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from pdclient.local import PDServers

from .helpers import metric

PREFILL_KV = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
PULLED = "vllm:external_prefix_cache_hits_total"
FILLER = " a"  # one token each in SmolLM2's tokenizer (and most BPE tokenizers)
CONVERSATIONS = 3


def block_size(base_v1_url: str) -> int:
    text = httpx.get(f"{base_v1_url.removesuffix('/v1')}/metrics", timeout=10).text
    found = re.search(r'^vllm:cache_config_info\{[^}]*\bblock_size="(\d+)"', text, re.M)
    assert found, "the server's /metrics has no cache_config_info with a block_size"
    return int(found.group(1))


def whole_blocks(tokens: int, block: int) -> int:
    return tokens // block * block


@dataclass
class Turn:
    messages: list[dict[str, Any]]
    prompt_ids: list[int]
    answer: str
    answer_ids: list[int]


def stream(http: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, list[int], list[int], dict[str, Any]]:
    """Text, generated ids, prompt ids and usage of a streamed chat call with return_token_ids."""
    text, ids, prompt_ids, usage = "", [], [], {}
    with http.stream("POST", f"{url}/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            prompt_ids = chunk.get("prompt_token_ids") or prompt_ids
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
                ids += choice.get("token_ids") or []
    return text, ids, prompt_ids, usage


def first_turn(http: httpx.Client, pd: PDServers, block: int) -> Turn:
    """A P/D turn whose prompt ends 8 ids before a block boundary: any answer of 9 ids or
    more fills a block that holds answer ids."""
    system = f"Conversation {uuid.uuid4().hex}. " + "Notes: the robot paints in the morning and sleeps at noon. " * 60
    user = {"role": "user", "content": "Tell me a short story about the robot in the notes."}

    def messages(padding: int) -> list[dict[str, Any]]:
        return [{"role": "system", "content": system + FILLER * padding}, user]

    def prefill(padding: int, kv: bool) -> dict[str, Any]:
        body = {"model": pd.model, "messages": messages(padding), "max_tokens": 1, "return_token_ids": True}
        response = http.post(
            f"{pd.prefill_url}/chat/completions", json={**body, **({"kv_transfer_params": PREFILL_KV} if kv else {})}
        )
        response.raise_for_status()
        return dict(response.json())

    padding = (block - 8 - len(prefill(0, kv=False)["prompt_token_ids"])) % block
    handoff = prefill(padding, kv=True)
    prompt_ids = handoff["prompt_token_ids"]
    assert len(prompt_ids) % block == block - 8, "the filler was not one token each: the test's assumption broke"
    kv = {**handoff["kv_transfer_params"], "prompt_token_ids": prompt_ids}
    # min_tokens: an answer long enough to fill a block whatever this CPU's greedy answer says.
    body = {"model": pd.model, "messages": messages(padding), "max_tokens": 64, "min_tokens": 16, "temperature": 0}
    body["stream"] = True
    answer, answer_ids, _, _ = stream(http, pd.decode_url, {**body, "return_token_ids": True, "kv_transfer_params": kv})
    assert len(answer_ids) >= 9, f"the answer is too short to fill a block: {answer!r}"
    return Turn(messages(padding), prompt_ids, answer, answer_ids)


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def re_rendered(turn: Turn, prompt_ids: list[int]) -> int:
    """How many ids of the previous prompt and answer the next prompt starts with: the whole
    previous prompt always, the answer as far as it re-renders to its own ids."""
    same = common_prefix(prompt_ids, turn.prompt_ids + turn.answer_ids)
    assert same >= len(turn.prompt_ids), "the previous prompt's ids changed in the next turn's prompt"
    return same


def next_turn(turn: Turn) -> list[dict[str, Any]]:
    return [
        *turn.messages,
        {"role": "assistant", "content": turn.answer},
        {"role": "user", "content": "Give it a title."},
    ]


def test_the_decode_server_holds_the_previous_turn_and_its_answer(pd: PDServers) -> None:
    block = block_size(pd.decode_url)
    for _ in range(CONVERSATIONS):
        with httpx.Client(timeout=280) as http:
            turn = first_turn(http, pd, block)
            before = {name: metric(pd.decode_url, name) for name in (HITS, QUERIES)}
            prefill_queries = metric(pd.prefill_url, QUERIES)
            body = {"model": pd.model, "messages": next_turn(turn), "max_tokens": 4, "temperature": 0, "stream": True}
            _, _, prompt_ids, _ = stream(http, pd.decode_url, {**body, "return_token_ids": True})
        same = re_rendered(turn, prompt_ids)
        if whole_blocks(same, block) > whole_blocks(len(turn.prompt_ids), block):
            break
        print(f"\nthe answer re-rendered to other ids {same - len(turn.prompt_ids)} ids in: another conversation")
    else:
        pytest.fail(f"in {CONVERSATIONS} conversations no answer re-rendered to its own ids past a block")
    hits = metric(pd.decode_url, HITS) - before[HITS]
    queries = metric(pd.decode_url, QUERIES) - before[QUERIES]
    previous = len(turn.prompt_ids) + len(turn.answer_ids)
    print(f"\n{same} of the previous turn's {previous} ids re-rendered alike")

    assert queries == len(prompt_ids)
    # Whole blocks of the previous prompt and of the answer as far as it re-rendered alike,
    # never its last id (sampled, never computed): more than the previous prompt alone.
    assert hits == whole_blocks(min(same, previous - 1), block)
    assert hits > whole_blocks(len(turn.prompt_ids), block)
    # Most of the prompt: what is left is the new message, its template and a partial block.
    assert queries - hits < len(prompt_ids) - min(same, previous) + block
    assert hits / queries > 0.8, f"{hits:.0f} of {queries:.0f} prompt ids were cached"
    assert metric(pd.prefill_url, QUERIES) == prefill_queries  # the prefill server was not involved


def test_through_a_second_handoff_the_prefill_recomputes_the_answer(pd: PDServers) -> None:
    block = block_size(pd.decode_url)
    with httpx.Client(timeout=280) as http:
        turn = first_turn(http, pd, block)
        prefill_before = metric(pd.prefill_url, HITS)
        decode_before = {name: metric(pd.decode_url, name) for name in (HITS, PULLED)}
        body = {"model": pd.model, "messages": next_turn(turn), "max_tokens": 1, "return_token_ids": True}
        response = http.post(f"{pd.prefill_url}/chat/completions", json={**body, "kv_transfer_params": PREFILL_KV})
        response.raise_for_status()
        handoff = response.json()
        prompt_ids = handoff["prompt_token_ids"]
        kv = {**handoff["kv_transfer_params"], "prompt_token_ids": prompt_ids}
        stream(http, pd.decode_url, {**body, "max_tokens": 4, "stream": True, "kv_transfer_params": kv})
    previous = len(turn.prompt_ids) + len(turn.answer_ids)
    same = re_rendered(turn, prompt_ids)

    # The prefill server holds the previous prompt's whole blocks, never the answer.
    assert metric(pd.prefill_url, HITS) - prefill_before == whole_blocks(len(turn.prompt_ids), block)
    # The decode server uses what it holds and pulls only the rest over NIXL.
    local = metric(pd.decode_url, HITS) - decode_before[HITS]
    assert local == whole_blocks(min(same, previous - 1), block)
    assert metric(pd.decode_url, PULLED) - decode_before[PULLED] == len(prompt_ids) - local
