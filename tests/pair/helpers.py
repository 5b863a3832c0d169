"""Small helpers shared by the end-to-end tests."""

from __future__ import annotations

import re
from typing import Any

import httpx
import openai

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 16}


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
