"""Fixtures for the framework tests: a respx fake of a vLLM P/D pair that can call tools.

The fake answers like vLLM 0.32 does: the prefill leg returns ``prompt_token_ids`` and
NIXL-style ``kv_transfer_params``; the decode leg answers with text (streamed with a final
``finish_reason`` chunk, as frameworks such as LiteLLM require) or, when the request offers
tools and has not had a tool result yet, with a tool call. Every decode body is recorded so
a test can check that the ids of the prefill reached it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.conftest import DECODE, NIXL_PARAMS, PREFILL

MODEL = "smollm2"
KV_PARAMS = NIXL_PARAMS
USAGE = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}


def ids_for(body: dict[str, Any]) -> list[int]:
    """Fake prompt ids, distinct per rendered request: one id per character of the messages."""
    text = json.dumps(body.get("messages") or body.get("prompt"), sort_keys=True)
    return [ord(c) % 1000 for c in text]


def _completion(message: dict[str, Any], finish_reason: str) -> dict[str, Any]:
    choice = {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
    return {
        "id": "chatcmpl-d",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [choice],
        "usage": USAGE,
    }


def _chunk(delta: dict[str, Any], finish_reason: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    choices = [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}]
    chunk: dict[str, Any] = {"id": "chatcmpl-d", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    chunk["choices"] = choices if usage is None else []
    if usage is not None:
        chunk["usage"] = usage
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def _tool_call(body: dict[str, Any]) -> dict[str, Any] | None:
    """The tool call to answer with: when tools are offered and no tool result came back yet."""
    tools = body.get("tools") or []
    if not tools or body.get("tool_choice") == "none":
        return None
    if any(m.get("role") == "tool" for m in body.get("messages", [])):
        return None
    choice = body.get("tool_choice")
    name = choice["function"]["name"] if isinstance(choice, dict) else tools[0]["function"]["name"]
    return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": json.dumps({"city": "Paris"})}}


@dataclass
class FakePair:
    """What the fake servers saw."""

    prefill_bodies: list[dict[str, Any]] = field(default_factory=list)
    decode_bodies: list[dict[str, Any]] = field(default_factory=list)
    answer: str = "The capital of France is Paris."
    router: Any = None
    """The respx router, to change a route's answer in a test."""

    def prefill(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.prefill_bodies.append(body)
        message = {"role": "assistant", "content": "The"}
        payload = _completion(message, "length")
        payload["prompt_token_ids"] = ids_for(body)
        payload["kv_transfer_params"] = KV_PARAMS
        return httpx.Response(200, json=payload)

    def decode(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.decode_bodies.append(body)
        call = _tool_call(body)
        if not body.get("stream"):
            if call is not None:
                return httpx.Response(
                    200, json=_completion({"role": "assistant", "content": None, "tool_calls": [call]}, "tool_calls")
                )
            return httpx.Response(200, json=_completion({"role": "assistant", "content": self.answer}, "stop"))
        if call is not None:
            pieces = [_chunk({"role": "assistant", "tool_calls": [{"index": 0, **call}]}), _chunk({}, "tool_calls")]
        else:
            words = self.answer.split(" ")
            pieces = [_chunk({"role": "assistant", "content": ""})]
            pieces += [_chunk({"content": w if i == 0 else " " + w}) for i, w in enumerate(words)]
            pieces.append(_chunk({}, "stop"))
        if (body.get("stream_options") or {}).get("include_usage"):
            pieces.append(_chunk({}, usage=USAGE))
        content = b"".join(pieces) + b"data: [DONE]\n\n"
        return httpx.Response(200, content=content, headers={"content-type": "text/event-stream"})

    def assert_handoffs(self, count: int) -> None:
        """``count`` calls each went prefill -> decode with the prefill's ids forwarded."""
        assert len(self.prefill_bodies) == count, self.prefill_bodies
        assert len(self.decode_bodies) == count, self.decode_bodies
        for prefill, decode in zip(self.prefill_bodies, self.decode_bodies, strict=True):
            assert prefill["max_tokens"] == 1 and prefill["stream"] is False
            assert decode["kv_transfer_params"]["prompt_token_ids"] == ids_for(prefill)
            assert decode["kv_transfer_params"]["remote_engine_id"] == "engine-p"


@pytest.fixture
def fake_pair() -> Iterator[FakePair]:
    """respx routes ``prefill`` and ``decode`` for PREFILL / DECODE, answered by a FakePair."""
    import respx

    pair = FakePair()
    with respx.mock(assert_all_called=False) as router:
        pair.router = router
        router.post(f"{PREFILL}/chat/completions", name="prefill").mock(side_effect=pair.prefill)
        router.post(f"{DECODE}/chat/completions", name="decode").mock(side_effect=pair.decode)
        router.get(f"{DECODE}/models", name="models").mock(
            return_value=httpx.Response(200, json={"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        )
        yield pair


@pytest.fixture
def prefill_down() -> Iterator[FakePair]:
    """Like ``fake_pair``, but the prefill server refuses connections."""
    import respx

    pair = FakePair()
    with respx.mock(assert_all_called=False) as router:
        router.post(f"{PREFILL}/chat/completions", name="prefill").mock(side_effect=httpx.ConnectError("refused"))
        router.post(f"{DECODE}/chat/completions", name="decode").mock(side_effect=pair.decode)
        yield pair
