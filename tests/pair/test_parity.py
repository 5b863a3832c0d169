"""Through PDChatClient / AsyncPDChatClient, a call gives the decode server's own greedy answer.

The reference is the same request sent to the decode server alone (no P/D). Each test
uses prompts no other test uses, so the P/D call's KV really comes from the prefill.
"""

from __future__ import annotations

import openai

from pdclient import PDTrace
from pdclient.local import PDServers

from .helpers import GREEDY, chat_text, completion_text, user


def test_chat_non_streamed(pd: PDServers, plain: openai.OpenAI) -> None:
    question = "What is the capital of France?"
    traces: list[PDTrace] = []
    with pd.client(on_trace=traces.append) as client:
        raw = client.chat.completions.with_raw_response.create(model=pd.model, messages=user(question), **GREEDY)
        answer = raw.parse().choices[0].message.content
    trace = PDTrace.from_headers(raw.headers)
    assert trace.fallback is None
    assert trace.forwarded_tokens > 0
    assert trace.prefill_url == pd.prefill_url and trace.decode_url == pd.decode_url
    assert traces and traces[-1].request_id == trace.request_id
    # The decode server's own answer, whatever it is on this CPU (never what the model knows).
    assert answer == chat_text(plain, pd.model, question)


def test_chat_streamed(pd: PDServers, plain: openai.OpenAI) -> None:
    question = "Name three primary colors."
    traces: list[PDTrace] = []
    with pd.client(on_trace=traces.append) as client:
        stream = client.chat.completions.create(model=pd.model, messages=user(question), stream=True, **GREEDY)
        with stream:
            deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([d for d in deltas if d]) > 1, "the answer should arrive in several chunks"
    assert "".join(deltas) == chat_text(plain, pd.model, question)
    assert traces[-1].fallback is None and traces[-1].forwarded_tokens > 0
    assert traces[-1].decode_first_byte_ms is not None


def test_completions(pd: PDServers, plain: openai.OpenAI) -> None:
    prompt = "The three largest planets of the solar system are"
    traces: list[PDTrace] = []
    with pd.client(on_trace=traces.append) as client:
        text = client.completions.create(model=pd.model, prompt=prompt, **GREEDY).choices[0].text
        stream = client.completions.create(model=pd.model, prompt=prompt, stream=True, **GREEDY)
        streamed = "".join(c.choices[0].text for c in stream if c.choices)
    assert text == streamed == completion_text(plain, pd.model, prompt)
    assert all(t.fallback is None and t.forwarded_tokens > 0 for t in traces)


async def test_async_chat_and_completions(pd: PDServers, plain: openai.OpenAI) -> None:
    question = "What is the largest ocean on Earth?"
    prompt = "A haiku about autumn leaves:"
    traces: list[PDTrace] = []
    async with pd.async_client(on_trace=traces.append) as client:
        r = await client.chat.completions.create(model=pd.model, messages=user(question), **GREEDY)
        stream = await client.chat.completions.create(model=pd.model, messages=user(question), stream=True, **GREEDY)
        streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        c = await client.completions.create(model=pd.model, prompt=prompt, **GREEDY)
    expected = chat_text(plain, pd.model, question)
    assert r.choices[0].message.content == expected
    assert streamed == expected
    assert c.choices[0].text == completion_text(plain, pd.model, prompt)
    assert len(traces) == 3 and all(t.fallback is None and t.forwarded_tokens > 0 for t in traces)
