"""The caller's ``usage`` of a disaggregated call: the prompt side is the prefill's, the rest the decode's.

The fake prefill reports ``prompt_tokens_details.cached_tokens`` 512 (its prefix-cache
hits) and the fake decode 999 (as a server that counts the pulled KV as hits would);
the caller must see the prefill's 512, streamed (the final usage chunk, whatever the
chunk boundaries) and not (a JSON body, whose length changes), and a decode-only call
the decode's own figures.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from tests.fake_vllm import DECODE, PREFILL, FakeVLLM, VLLMAnswers, echo
from tests.twins import Twin

MESSAGES = [{"role": "user", "content": "What is in the cache?"}]


class Pieces(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A body sent in pieces of its own size (an SSE event, a usage key, split anywhere)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def __iter__(self) -> Iterator[bytes]:
        yield from self.pieces

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for piece in self.pieces:
            yield piece


class Answers(VLLMAnswers):
    def prefill(self, path: str, body: dict[str, Any], request_id: str = "req-p") -> dict[str, Any]:
        answer = super().prefill(path, body, request_id)
        answer["usage"]["prompt_tokens_details"] = {"cached_tokens": 512, "created_cache_tokens": 128}
        return answer

    def usage(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        usage: dict[str, Any] = dict(super().usage(path, body))
        usage["prompt_tokens_details"] = {"cached_tokens": 999}
        return usage


@pytest.fixture
def fake() -> Iterator[FakeVLLM]:
    vllm = FakeVLLM(Answers())
    with vllm.routes(PREFILL, DECODE):
        yield vllm


def prompt_tokens(fake: FakeVLLM) -> int:
    return len(fake.answers.ids({"messages": MESSAGES}))


@pytest.mark.parametrize("split", [None, 7], ids=["whole-events", "cut-every-7-bytes"])
async def test_a_streamed_call_reports_the_prefills_cached_tokens(mode: str, fake: FakeVLLM, split: int | None) -> None:
    if split is not None:

        def cut(request: httpx.Request) -> httpx.Response:
            response = fake.respond(request)
            if "text/event-stream" not in response.headers.get("content-type", ""):
                return response
            body = response.read()
            pieces = [body[i : i + split] for i in range(0, len(body), split)]
            return httpx.Response(200, stream=Pieces(pieces), headers=response.headers)

        fake.router.routes["decode"].side_effect = cut
    t = Twin(mode)
    stream = await t.chat(messages=MESSAGES, stream=True, stream_options={"include_usage": True})
    chunks = list(stream) if mode == "sync" else [c async for c in stream]
    usage = chunks[-1].usage
    assert usage is not None and chunks[-1].choices == []
    assert usage.prompt_tokens == prompt_tokens(fake)
    assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 512
    assert usage.prompt_tokens_details.model_extra == {"created_cache_tokens": 128}
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == echo({"messages": MESSAGES})
    await t.close()


async def test_a_json_call_reports_the_prefills_cached_tokens(mode: str, fake: FakeVLLM) -> None:
    t = Twin(mode)
    raw = await t.call(t.client.chat.completions.with_raw_response.create, model="m", messages=MESSAGES)
    assert "content-length" not in raw.headers or int(raw.headers["content-length"]) == len(raw.content)
    completion = raw.parse()
    assert completion.usage.prompt_tokens_details.cached_tokens == 512
    assert completion.choices[0].message.content == echo({"messages": MESSAGES})
    await t.close()


async def test_a_decode_only_call_reports_the_decodes_usage(mode: str, fake: FakeVLLM) -> None:
    t = Twin(mode, remote_prefill="never")
    completion = await t.chat(messages=MESSAGES)
    assert completion.usage.prompt_tokens_details.cached_tokens == 999
    await t.close()
