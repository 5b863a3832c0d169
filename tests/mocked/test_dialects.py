"""Responses and Messages through the handoff, against a fake vLLM pair (respx).

The fake prefill answers as a vLLM with pdclient's server patch does (the prompt's ids in
its answer's ``kv_transfer_params`` when the leg asks with ``return_prompt_token_ids``),
or, with ``patched=False``, as a plain vLLM 0.32 does (no ids). The decode answers as
vLLM's Responses and Messages servers do, streamed (their typed events) or not. Each
test checks both legs' exact bodies, the trace, and the usage the caller gets.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import anthropic
import httpx
import openai
import pytest
import respx

from pdclient import AsyncPDTransport, Outcome, PDOptions, PDTrace, PDTransport
from tests.fake_vllm import DECODE, DECODE2, NIXL_PARAMS, PREFILL, CutStream
from tests.twins import Twin

IDS = [101, 7, 9000, 42, 5]
TEXT = ["Hello", " there"]
Body = dict[str, Any]


def _sse(events: list[Body]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def _response(text: str, usage: Body, **extra: Any) -> Body:
    item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed"}
    item["content"] = [{"type": "output_text", "text": text, "annotations": []}]
    return {
        "id": "resp_1",
        "object": "response",
        "created_at": 1,
        "model": "m",
        "status": "completed",
        "output": [item],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage,
        **extra,
    }


def _responses_usage(cached: int, output: int) -> Body:
    return {
        "input_tokens": len(IDS),
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": len(IDS) + output,
    }


def _message(text: str, usage: Body) -> Body:
    return {
        "id": "msg_1",
        "type": "message",
        "role": "assistant",
        "model": "m",
        "content": [{"type": "text", "text": text}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": usage,
    }


def _messages_usage(cached: int, output: int) -> Body:
    return {"input_tokens": len(IDS) - cached, "cache_read_input_tokens": cached, "output_tokens": output}


@dataclass
class FakePair:
    """A prefill and a decode answering /responses and /messages; records every body."""

    patched: bool = True
    prompt_token_ids: list[int] = field(default_factory=lambda: IDS)
    """What the prefill returns as the prompt's ids (their count teaches auto's chars-per-token ratio)."""
    prefill_bodies: list[Body] = field(default_factory=list)
    decode_bodies: list[Body] = field(default_factory=list)
    passed: list[str] = field(default_factory=list)

    def prefill(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.prefill_bodies.append(body)
        kv: Body = dict(NIXL_PARAMS)
        if self.patched and body["kv_transfer_params"].get("return_prompt_token_ids"):
            kv["prompt_token_ids"] = self.prompt_token_ids
        if request.url.path.endswith("/responses"):
            return httpx.Response(200, json=_response("A", _responses_usage(3, 1), kv_transfer_params=kv))
        answer = _message("A", _messages_usage(3, 1))
        return httpx.Response(200, json={**answer, "kv_transfer_params": kv})

    def decode(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        self.decode_bodies.append(body)
        text = "".join(TEXT)
        responses = request.url.path.endswith("/responses")
        if not body.get("stream"):
            if responses:
                return httpx.Response(200, json=_response(text, _responses_usage(5, 2)))
            return httpx.Response(200, json=_message(text, _messages_usage(5, 2)))
        if responses:
            done = _response(text, _responses_usage(5, 2))
            events: list[Body] = [{"type": "response.created", "response": {**done, "status": "in_progress"}}]
            for piece in TEXT:
                events.append(
                    {
                        "type": "response.output_text.delta",
                        "item_id": "msg_1",
                        "output_index": 0,
                        "content_index": 0,
                        "delta": piece,
                        "logprobs": [],
                    }
                )
            events.append({"type": "response.completed", "response": done})
            for n, event in enumerate(events):
                event["sequence_number"] = n
        else:
            start = _message("", _messages_usage(5, 0))
            start["content"] = []
            events = [{"type": "message_start", "message": start}]
            events.append({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})
            for piece in TEXT:
                events.append(
                    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
                )
            events.append({"type": "content_block_stop", "index": 0})
            events.append(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                    "usage": _messages_usage(5, 2),
                }
            )
            events.append({"type": "message_stop"})
        return httpx.Response(200, content=_sse(events), headers={"content-type": "text/event-stream"})

    def count_tokens(self, request: httpx.Request) -> httpx.Response:
        self.passed.append(request.url.path)
        return httpx.Response(200, json={"input_tokens": len(IDS)})


@pytest.fixture(params=[True, False], ids=["patched", "unpatched"])
def pair(request: pytest.FixtureRequest) -> Iterator[FakePair]:
    fake = FakePair(patched=request.param)
    with respx.mock(assert_all_called=False) as router:
        for route in ("/responses", "/messages"):
            router.post(f"{PREFILL}{route}").mock(side_effect=fake.prefill)
            router.post(f"{DECODE}{route}").mock(side_effect=fake.decode)
            router.post(f"{DECODE2}{route}").mock(side_effect=fake.decode)
        router.post(f"{DECODE}/messages/count_tokens").mock(side_effect=fake.count_tokens)
        yield fake


def _check_legs(pair: FakePair, trace: PDTrace, route: str, *, short: dict[str, Any]) -> None:
    (prefill,), (decode,) = pair.prefill_bodies, pair.decode_bodies
    for name, value in short.items():
        assert prefill[name] == value, (name, prefill)
    assert prefill["stream"] is False and "background" not in prefill
    assert prefill["kv_transfer_params"]["do_remote_decode"] is True
    assert prefill["kv_transfer_params"]["return_prompt_token_ids"] is True
    assert "store" not in decode or decode["store"] == prefill.get("caller_store")
    kv = decode["kv_transfer_params"]
    assert kv["remote_engine_id"] == NIXL_PARAMS["remote_engine_id"]
    assert trace.route == route and trace.outcome is Outcome.DISAGGREGATED
    if pair.patched:
        assert kv["prompt_token_ids"] == IDS and trace.forwarded_tokens == len(IDS) and trace.ids_skipped is None
    else:
        assert "prompt_token_ids" not in kv and trace.forwarded_tokens == 0
        assert trace.ids_skipped is not None and "server patch" in trace.ids_skipped


# -- Responses -----------------------------------------------------------------------------------


async def test_responses_create_is_a_handoff(mode: str, pair: FakePair) -> None:
    traces: list[PDTrace] = []
    t = Twin(mode, on_trace=traces.append)
    raw = await t.call(
        t.client.responses.with_raw_response.create,
        model="m",
        input="Say hi",
        background=False,
        max_output_tokens=50,
    )
    answer = raw.parse()
    assert answer.output_text == "".join(TEXT)
    _check_legs(pair, traces[0], "responses", short={"max_output_tokens": 1, "store": False})
    assert pair.decode_bodies[0]["max_output_tokens"] == 50 and pair.decode_bodies[0]["background"] is False
    assert raw.headers["x-pd-outcome"] == "disaggregated"
    # The input side is the prefill's, the output side the decode's.
    assert answer.usage.input_tokens_details.cached_tokens == 3
    assert answer.usage.output_tokens == 2 and answer.usage.total_tokens == len(IDS) + 2
    await t.close()


async def test_responses_stream_reaches_the_caller_as_typed_events(mode: str, pair: FakePair) -> None:
    traces: list[PDTrace] = []
    t = Twin(mode, on_trace=traces.append)
    stream = await t.call(
        t.client.responses.create, model="m", input=[{"role": "user", "content": "Say hi"}], stream=True
    )
    events = list(stream) if mode == "sync" else [e async for e in stream]
    assert [e.delta for e in events if e.type == "response.output_text.delta"] == TEXT
    assert pair.decode_bodies[0]["stream"] is True
    _check_legs(pair, traces[0], "responses", short={"max_output_tokens": 1, "store": False})
    completed = events[-1]
    assert completed.type == "response.completed"
    assert completed.response.usage.input_tokens_details.cached_tokens == 3
    assert completed.response.usage.output_tokens == 2
    await t.close()


async def test_responses_refusals_match_chats(mode: str, pair: FakePair) -> None:
    t = Twin(mode)
    with pytest.raises(Exception) as caught:
        await t.call(t.client.responses.create, model="m", input="hi", extra_body={"kv_transfer_params": {}})
    assert getattr(caught.value, "status_code", None) == 400 and "kv_transfer_params" in str(caught.value)
    with pytest.raises(Exception) as caught:
        await t.call(t.client.responses.create, model="m", input="hi", extra_body={"pdclient": {"no_such": 1}})
    assert getattr(caught.value, "status_code", None) == 400 and "no_such" in str(caught.value)
    assert pair.prefill_bodies == [] and pair.decode_bodies == []
    await t.close()


async def test_a_broken_responses_stream_is_not_moved_and_says_why() -> None:
    pair = FakePair()
    traces: list[PDTrace] = []
    t = Twin("sync", decode_base_url=[DECODE, DECODE2], on_trace=traces.append)
    created = {"type": "response.created", "sequence_number": 0, "response": _response("", _responses_usage(0, 0))}

    def cut(request: httpx.Request) -> httpx.Response:
        pair.decode_bodies.append(json.loads(request.content))
        stream = CutStream([_sse([created])])
        return httpx.Response(200, stream=stream, headers={"content-type": "text/event-stream"})

    with respx.mock(assert_all_called=False) as router:
        router.post(f"{PREFILL}/responses").mock(side_effect=pair.prefill)
        router.post(f"{DECODE}/responses").mock(side_effect=cut)
        router.post(f"{DECODE2}/responses").mock(side_effect=cut)
        with pytest.raises(openai.APIConnectionError):
            for _ in t.client.responses.create(model="m", input="hi", stream=True):
                pass
    assert len(pair.decode_bodies) == 1
    assert traces[0].error is not None and "not migrated: the Responses API" in traces[0].error
    await t.close()


@pytest.mark.parametrize("state", ["previous_response_id", "conversation"])
async def test_a_call_on_stored_state_runs_decode_only_where_it_is(mode: str, pair: FakePair, state: str) -> None:
    traces: list[PDTrace] = []
    t = Twin(mode, on_trace=traces.append, remote_prefill="always")
    answer = await t.call(t.client.responses.create, model="m", input="and then?", **{state: "resp_0"})
    assert answer.output_text == "".join(TEXT)
    assert pair.prefill_bodies == []  # the prefill server never has the stored state
    (decode,) = pair.decode_bodies
    assert decode[state] == "resp_0" and "kv_transfer_params" not in decode
    trace = traces[0]
    assert trace.outcome is Outcome.DECODE_ONLY and trace.remote_prefill is False
    assert trace.remote_prefill_reason == "stored_state"
    await t.close()


async def test_without_a_store_the_caller_gets_the_decode_servers_404(mode: str) -> None:
    missing = {"error": {"message": "Response with id 'resp_0' not found.", "type": "invalid_request_error"}}
    t = Twin(mode)
    with respx.mock(assert_all_called=False) as router:
        prefill = router.post(f"{PREFILL}/responses").mock(return_value=httpx.Response(500))
        router.post(f"{DECODE}/responses").mock(return_value=httpx.Response(404, json=missing))
        with pytest.raises(openai.NotFoundError) as caught:
            await t.call(t.client.responses.create, model="m", input="hi", previous_response_id="resp_0")
    assert "resp_0" in str(caught.value) and not prefill.called
    await t.close()


@pytest.mark.parametrize("route", ["/responses", "/messages"])
def test_an_interrupt_between_legs_releases_the_prefills_kv(route: str) -> None:
    pair = FakePair()
    calls: list[Body] = []

    def interrupted(request: httpx.Request) -> httpx.Response:
        calls.append(json.loads(request.content))
        if len(calls) == 1:
            raise KeyboardInterrupt
        return pair.decode(request)

    t = Twin("sync")
    body = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}], "input": "hi"}
    with respx.mock(assert_all_called=False) as router:
        router.post(f"{PREFILL}{route}").mock(side_effect=pair.prefill)
        router.post(f"{DECODE}{route}").mock(side_effect=interrupted)
        with pytest.raises(KeyboardInterrupt):
            t.client.post(route, body=body, cast_to=httpx.Response)
        deadline = time.monotonic() + 5
        while len(calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    release = calls[1]
    assert release["stream"] is False
    assert release["kv_transfer_params"] == {**NIXL_PARAMS, "prompt_token_ids": IDS}
    if route == "/responses":
        assert release["max_output_tokens"] == 1 and release["store"] is False
    else:
        assert release["max_tokens"] == 1


# -- Messages ------------------------------------------------------------------------------------


def _anthropic(mode: str, traces: list[PDTrace]) -> Any:
    """The anthropic SDK over the handoff, as its users write it: an httpx client on a P/D transport."""
    options = PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODE, on_trace=traces.append)
    if mode == "sync":
        http: Any = httpx.Client(transport=PDTransport(options=options))
        return anthropic.Anthropic(base_url=DECODE.removesuffix("/v1"), api_key="-", http_client=http, max_retries=0)
    http = httpx.AsyncClient(transport=AsyncPDTransport(options=options))
    return anthropic.AsyncAnthropic(base_url=DECODE.removesuffix("/v1"), api_key="-", http_client=http, max_retries=0)


async def _maybe(value: Any) -> Any:
    return await value if hasattr(value, "__await__") else value


async def test_messages_create_is_a_handoff(mode: str, pair: FakePair) -> None:
    traces: list[PDTrace] = []
    client = _anthropic(mode, traces)
    message = await _maybe(
        client.messages.create(
            model="m", max_tokens=50, system="Be brief.", messages=[{"role": "user", "content": "Say hi"}]
        )
    )
    assert message.content[0].text == "".join(TEXT)
    _check_legs(pair, traces[0], "messages", short={"max_tokens": 1})
    assert pair.decode_bodies[0]["max_tokens"] == 50 and pair.decode_bodies[0]["system"] == "Be brief."
    assert message.usage.cache_read_input_tokens == 3 and message.usage.input_tokens == len(IDS) - 3
    assert message.usage.output_tokens == 2
    await _maybe(client.close())


async def test_messages_stream_is_a_handoff(mode: str, pair: FakePair) -> None:
    traces: list[PDTrace] = []
    client = _anthropic(mode, traces)
    request = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "Say hi"}]}
    if mode == "sync":
        with client.messages.stream(**request) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    else:
        async with client.messages.stream(**request) as stream:
            text = "".join([piece async for piece in stream.text_stream])
            final = await stream.get_final_message()
    assert text == "".join(TEXT)
    _check_legs(pair, traces[0], "messages", short={"max_tokens": 1})
    assert final.usage.cache_read_input_tokens == 3 and final.usage.output_tokens == 2
    await _maybe(client.close())


async def test_count_tokens_passes_through(mode: str, pair: FakePair) -> None:
    traces: list[PDTrace] = []
    client = _anthropic(mode, traces)
    counted = await _maybe(client.messages.count_tokens(model="m", messages=[{"role": "user", "content": "hi"}]))
    assert counted.input_tokens == len(IDS)
    assert pair.passed == ["/v1/messages/count_tokens"] and pair.prefill_bodies == []
    assert all(t.outcome is Outcome.PASSTHROUGH for t in traces)
    await _maybe(client.close())


async def test_a_responses_call_stays_sequential_under_concurrent_dispatch(mode: str, pair: FakePair) -> None:
    """Its events carry no prompt ids to check the decode against, and vLLM's Responses route
    runs its engine request under the body's ``request_id``, which no leg id can pair with:
    even an explicit ``"concurrent"`` sends its legs one after the other."""
    traces: list[PDTrace] = []
    t = Twin(mode, decode_base_url=[DECODE, DECODE2], dispatch="concurrent", on_trace=traces.append)
    for _ in range(2):  # a chat call's second call would go concurrent here
        stream = await t.call(t.client.responses.create, model="m", input="Say hi", max_output_tokens=50, stream=True)
        events = list(stream) if mode == "sync" else [e async for e in stream]
        assert [e.delta for e in events if e.type == "response.output_text.delta"] == TEXT
    assert [trace.dispatch for trace in traces] == ["sequential", "sequential"]
    assert all(body["kv_transfer_params"].get("do_remote_prefill") for body in pair.decode_bodies)
    await t.close()


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_auto_follow_ups_run_decode_only_where_the_conversation_is(route: str) -> None:
    """``auto`` reads Responses input items and Messages turns as a conversation: the first turn
    is a handoff, each short follow-up runs decode-only on the endpoint that holds it."""
    pair = FakePair(prompt_token_ids=[7] * 420)  # the first turn's ~1,700 chars at ~4 per token
    traces: list[PDTrace] = []
    options = PDOptions(PREFILL, [DECODE, DECODE2], remote_prefill="auto", on_trace=traces.append)
    http = httpx.Client(transport=PDTransport(options=options))
    turns: list[dict[str, Any]] = [{"role": "user", "content": "Tell me about the Roman empire in detail. " * 40}]
    with respx.mock(assert_all_called=False) as router:
        for base in (PREFILL, DECODE, DECODE2):
            router.post(f"{base}/{route}").mock(side_effect=pair.prefill if base == PREFILL else pair.decode)
        for question in ("And then?", "Why?", ""):
            if route == "responses":
                text = (
                    openai.OpenAI(base_url=DECODE, api_key="-", http_client=http)
                    .responses.create(model="m", input=turns)
                    .output_text
                )
            else:
                client = anthropic.Anthropic(base_url=DECODE.removesuffix("/v1"), api_key="-", http_client=http)
                block = client.messages.create(model="m", max_tokens=20, messages=turns).content[0]
                text = block.text if isinstance(block, anthropic.types.TextBlock) else ""
            if question:
                turns += [{"role": "assistant", "content": text}, {"role": "user", "content": question}]
    assert [t.outcome for t in traces] == [Outcome.DISAGGREGATED, Outcome.DECODE_ONLY, Outcome.DECODE_ONLY], [
        (t.remote_prefill_reason, t.conversation, t.estimated_prompt_tokens, t.estimated_uncached_tokens)
        for t in traces
    ]
    assert len({t.decode_url for t in traces}) == 1
    assert len(pair.prefill_bodies) == 1
