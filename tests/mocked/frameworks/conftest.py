"""Fixtures for the framework tests: the fake vLLM pair as a framework sees it, able to call tools.

The decode answers with text (streamed with a final ``finish_reason`` chunk, as frameworks
such as LiteLLM require) or, when the request offers tools and has not had a tool result
yet, with a tool call. Every body is recorded, so a test can check that the ids of the
prefill reached the decode.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.fake_vllm import DECODE, PREFILL, FakeVLLM, VLLMAnswers, ids_of_conversation

MODEL = "stub-model"
ANSWER = "The capital of France is Paris."

FakePair = FakeVLLM


def framework_answers() -> VLLMAnswers:
    return VLLMAnswers(ids=ids_of_conversation, text=lambda body: ANSWER, pieces=_words)


def _words(text: str) -> list[str]:
    words = text.split(" ")
    return [words[0], *(" " + w for w in words[1:])]


@pytest.fixture
def fake_pair() -> Iterator[FakeVLLM]:
    """respx routes ``prefill``, ``decode`` and ``models`` for PREFILL / DECODE, answered by the fake vLLM."""
    fake = FakeVLLM(framework_answers())
    with fake.routes(PREFILL, DECODE):
        yield fake


@pytest.fixture
def prefill_down() -> Iterator[FakeVLLM]:
    """Like ``fake_pair``, but the prefill server refuses connections."""
    fake = FakeVLLM(framework_answers())
    with fake.routes(PREFILL, DECODE) as router:
        router.routes["prefill"].mock(side_effect=httpx.ConnectError("refused"))
        yield fake
