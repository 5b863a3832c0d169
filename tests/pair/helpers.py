"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import httpx
import openai

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 16}
TOP_LOGPROBS = 5
WITH_LOGPROBS: dict[str, Any] = {"logprobs": True, "top_logprobs": TOP_LOGPROBS}
"""Asked for on both sides of a comparison that may meet a bf16 near-tie (``same_greedy_answer``)."""

LONG_STORY = "Write a long story about a lighthouse keeper and a storm."
"""The prompt of the answers the kill tests cut, and of the one whose pace sizes them (``killed_answer_tokens``)."""

END_OF_TURN = "<|im_end|>"
"""SmolLM2's end of turn (ChatML), the token an answer that stops has chosen."""
Top = list[tuple[str, float]]
"""One generated token's best candidates, (token, logprob), best first, as the server saw them."""


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def chat_text(client: openai.OpenAI, model: str, text: str, **extra: Any) -> str:
    r = client.chat.completions.create(model=model, messages=user(text), **GREEDY, **extra)  # type: ignore[arg-type]
    return r.choices[0].message.content or ""


def completion_text(client: openai.OpenAI, model: str, prompt: str) -> str:
    return client.completions.create(model=model, prompt=prompt, **GREEDY).choices[0].text


def metric(base_v1_url: str, name: str) -> float:
    """Sum of a Prometheus metric's samples on a vLLM server's /metrics (0 when absent)."""
    root = base_v1_url.removesuffix("/v1")
    text = httpx.get(f"{root}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def tops(logprobs: Any) -> list[Top]:
    """Per generated token, its top candidates, from a chat choice's ``logprobs`` (message or delta)."""
    entries = (logprobs.content or []) if logprobs else []
    return [[(t.token, t.logprob) for t in entry.top_logprobs] for entry in entries]


def same_greedy_answer(answer: Sequence[Top], reference: Sequence[Top]) -> str:
    """Assert two greedy answers agree as vLLM's own tests accept (``check_logprobs_close``).

    Equal tokens, or equal up to the first difference where each side's token is among the
    other side's top candidates: the same prompt's KV computed another way (a handoff, a
    prefix-cache hit, a chunked prefill, a migration) may order a bf16 near-tie either way,
    and after that the answers are different texts. An answer that stopped where the other
    went on chose the end of turn there (not in its logprobs), which must be among the
    other's candidates. Returns what was found, for the log.
    """
    assert answer and reference, "logprobs missing: ask for them with WITH_LOGPROBS"
    for at, (ours, theirs) in enumerate(zip(answer, reference, strict=False)):
        ours_token, theirs_token = ours[0][0], theirs[0][0]
        if ours_token == theirs_token:
            continue
        assert theirs_token in dict(ours) and ours_token in dict(theirs), (
            f"the answers differ at token {at} without a near-tie: {ours} against {theirs}"
        )
        gap = abs(theirs[0][1] - dict(theirs)[ours_token])
        return f"differ from token {at} at a near-tie ({gap:.3f} nats): {ours[:2]} against {theirs[:2]}"
    if len(answer) != len(reference):
        at = min(len(answer), len(reference))
        went_on = (answer if len(answer) > at else reference)[at]
        assert END_OF_TURN in dict(went_on), f"one answer ended at token {at}, the other went on: {went_on}"
        return f"one answer ended at token {at}, at a near-tie: {went_on[:2]}"
    return "equal"


async def agent_outcome(agents: Any, agent: Any, question: str, max_turns: int = 3) -> tuple[str, str]:
    """What an Agents SDK run did, whatever the model says: the text of its streamed deltas and
    how it ended.

    The same tiny model gives different greedy answers on different CPUs, and on some of them
    it calls a tool with arguments that are not JSON, loops on the tool, or runs past the token
    budget, which the SDK reports as an error (``response.incomplete`` on the Responses
    model). Each is an outcome the direct run reaches too, so a P/D run is compared with it
    character for character and ending for ending rather than asserted to succeed. Not delta
    for delta: a vLLM server whose API process falls behind its engine sends the tokens made
    meanwhile as one delta (seen on a slow CPU: ``'La fem'`` through P/D, ``'La', ' fem'``
    from the decode alone).
    """
    deltas: list[str] = []
    run = agents.Runner.run_streamed(agent, question, max_turns=max_turns)
    try:
        async for event in run.stream_events():
            data = getattr(event, "data", None)
            if event.type == "raw_response_event" and str(getattr(data, "type", "")).endswith(".delta"):
                deltas.append(str(getattr(data, "delta", "")))
    except agents.exceptions.AgentsException as error:
        return "".join(deltas), f"{type(error).__name__}: {error}"
    return "".join(deltas), f"final output: {run.final_output!r}"
