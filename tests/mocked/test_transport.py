"""The handoff over HTTP, with respx standing in for vLLM: every test runs sync and async."""

from __future__ import annotations

import json
import re
import threading
from typing import Any

import httpx
import openai
import pytest
import respx

from pdclient import AsyncPDChatClient, AsyncPDTransport, PDChatClient, PDOptions, PDTrace, PDTransport
from pdclient.wire import TRACE_HEADERS_EXTENSION
from tests.fake_vllm import DECODE, NIXL_PARAMS, PREFILL, chat_chunk, chat_json, ids_for, prefill_json
from tests.twins import Twin, status_error

MESSAGES = [{"role": "user", "content": "What is P/D?"}]


def body_of(route: respx.Route, index: int = 0) -> dict[str, Any]:
    return dict(json.loads(route.calls[index].request.content))


async def test_each_leg_gets_the_exact_body_and_headers(mode: str, pd_routes: respx.MockRouter) -> None:
    twin = Twin(mode, default_headers={"X-Team": "serving"})
    completion = await twin.chat(
        messages=MESSAGES,
        max_completion_tokens=32,
        temperature=0,
        extra_body={"top_k": 1, "chat_template_kwargs": {"enable_thinking": False}},
        extra_headers={"X-Caller": "test"},
    )
    assert completion.choices[0].message.content == "echo:What is P/D?"
    prefill, decode = pd_routes["prefill"], pd_routes["decode"]
    assert body_of(prefill) == {
        "model": "m",
        "messages": MESSAGES,
        "max_completion_tokens": 1,
        "temperature": 0,
        "top_k": 1,
        "chat_template_kwargs": {"enable_thinking": False},
        "stream": False,
        "max_tokens": 1,
        "n": 1,
        "return_token_ids": True,
        "kv_transfer_params": {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        },
    }
    assert body_of(decode) == {
        "model": "m",
        "messages": MESSAGES,
        "max_completion_tokens": 32,
        "temperature": 0,
        "top_k": 1,
        "chat_template_kwargs": {"enable_thinking": False},
        "kv_transfer_params": {**NIXL_PARAMS, "prompt_token_ids": ids_for("What is P/D?")},
    }
    p_headers, d_headers = prefill.calls[0].request.headers, decode.calls[0].request.headers
    assert p_headers["x-request-id"] == d_headers["x-request-id"]
    assert p_headers["x-request-id"].startswith("pd-")
    for headers in (p_headers, d_headers):
        assert headers["authorization"] == "Bearer sk-test"
        assert headers["x-caller"] == "test"
        assert headers["x-team"] == "serving"
    assert p_headers["host"] == "prefill.test:8100"
    assert d_headers["host"] == "decode.test:8200"
    await twin.close()


async def test_a_callers_request_id_never_becomes_the_legs_id(mode: str, pd_routes: respx.MockRouter) -> None:
    """vLLM's push mode pairs a decode with a prefill by the id both legs carry: a caller
    that could choose or predict it could run its legs under another call's id. The
    caller's id stays a correlation id (the trace's ``request_id``)."""
    traces: list[PDTrace] = []
    twin = Twin(mode, on_trace=traces.append)
    for _ in range(3):
        await twin.chat(messages=MESSAGES, extra_headers={"X-Request-Id": "mine-1"})
    await twin.chat(messages=MESSAGES)
    prefill_ids = [c.request.headers["x-request-id"] for c in pd_routes["prefill"].calls]
    decode_ids = [c.request.headers["x-request-id"] for c in pd_routes["decode"].calls]
    assert prefill_ids == decode_ids and len(set(prefill_ids)) == 4
    for leg_id in prefill_ids:
        assert re.fullmatch(r"pd-[0-9a-f]{32}", leg_id), f"{leg_id!r} is not 128 random bits"
    # Not one per-process prefix and a counter: no two ids share their first half.
    assert len({leg_id[:19] for leg_id in prefill_ids}) == 4
    assert [t.request_id for t in traces[:3]] == ["mine-1"] * 3
    assert traces[3].request_id not in prefill_ids, "a correlation id made here is not the legs' id either"
    assert [t.leg_request_id for t in traces] == prefill_ids
    raw = await twin.call(twin.client.chat.completions.with_raw_response.create, model="m", messages=MESSAGES)
    header_trace = PDTrace.from_headers(raw.headers)
    assert header_trace.leg_request_id is None, "the legs' id is not the caller's to see"


async def test_streamed_chat_arrives_as_real_chunks(mode: str, pd_routes: respx.MockRouter) -> None:
    twin = Twin(mode)
    stream = await twin.chat(messages=MESSAGES, stream=True, stream_options={"include_usage": True})
    assert isinstance(stream, openai.Stream | openai.AsyncStream)
    pieces = await twin.stream_text(messages=MESSAGES)
    assert "".join(pieces) == "echo:What is P/D?" and len(pieces) == 2
    decode = body_of(pd_routes["decode"])
    assert decode["stream"] is True and decode["stream_options"] == {"include_usage": True}
    assert "stream_options" not in body_of(pd_routes["prefill"])


async def test_decode_stream_is_not_buffered(mode: str, pd_routes: respx.MockRouter) -> None:
    """The second chunk is only produced after the caller has seen the first one."""
    first_seen = threading.Event()

    def gated_chunks() -> Any:
        yield chat_chunk("one")
        assert first_seen.wait(5), "the caller did not get chunk one before chunk two was produced"
        yield chat_chunk("two") + b"data: [DONE]\n\n"

    async def agated_chunks() -> Any:
        for chunk in gated_chunks():
            yield chunk

    stream = agated_chunks() if mode == "async" else gated_chunks()
    pd_routes["decode"].mock(
        return_value=httpx.Response(200, stream=stream, headers={"content-type": "text/event-stream"})
    )  # type: ignore[arg-type]
    twin = Twin(mode)
    seen: list[str] = []
    result = await twin.chat(messages=MESSAGES, stream=True)
    if mode == "sync":
        for chunk in result:
            seen.append(chunk.choices[0].delta.content)
            first_seen.set()
    else:
        async for chunk in result:
            seen.append(chunk.choices[0].delta.content)
            first_seen.set()
    assert seen == ["one", "two"]


async def test_trace_reaches_headers_and_callback(mode: str, pd_routes: respx.MockRouter) -> None:
    traces: list[PDTrace] = []
    twin = Twin(mode, on_trace=traces.append)
    raw = await twin.call(twin.client.chat.completions.with_raw_response.create, model="m", messages=MESSAGES)
    header_trace = PDTrace.from_headers(raw.headers)
    assert raw.headers["x-pd-forwarded-tokens"] == str(len("What is P/D?"))
    assert header_trace.prefill_url == PREFILL and header_trace.decode_url == DECODE
    assert header_trace.route == "chat" and header_trace.fallback is None
    assert header_trace.prefill_ms is not None and header_trace.prefill_ms >= 0
    completion = raw.parse()
    assert completion.choices[0].message.content == "echo:What is P/D?"
    assert len(traces) == 1
    trace = traces[0]
    assert trace.request_id == header_trace.request_id
    assert trace.decode_first_byte_ms is not None and trace.decode_first_byte_ms >= 0
    assert trace.forwarded_tokens == len("What is P/D?")
    assert trace.handoff_cpu_ms is not None


async def test_with_streaming_response(mode: str, pd_routes: respx.MockRouter) -> None:
    twin = Twin(mode)
    create = twin.client.chat.completions.with_streaming_response.create
    if mode == "sync":
        with create(model="m", messages=MESSAGES, stream=True) as response:  # type: ignore[call-overload]
            lines = [line for line in response.iter_lines() if line]
            headers = response.headers
    else:
        async with create(model="m", messages=MESSAGES, stream=True) as response:  # type: ignore[call-overload]
            lines = [line async for line in response.iter_lines() if line]
            headers = response.headers
    assert lines[-1] == "data: [DONE]" and headers["x-pd-route"] == "chat"


async def test_with_options_keeps_pd_and_applies_the_option(mode: str, pd_routes: respx.MockRouter) -> None:
    twin = Twin(mode)
    copy = twin.client.with_options(timeout=7, max_retries=1)
    assert type(copy) is type(twin.client)
    assert copy.pd_options is twin.client.pd_options and copy.pd_fleet is twin.client.pd_fleet
    assert copy.timeout == 7 and copy.max_retries == 1
    await twin.chat(copy, messages=MESSAGES)
    assert pd_routes["prefill"].call_count == 1 and pd_routes["decode"].call_count == 1
    timeouts = [call.request.extensions["timeout"] for call in pd_routes.calls]
    assert all(6 < t["read"] <= 7 for t in timeouts), "the per-call timeout reaches both legs"


async def test_with_options_can_move_the_decode_leg(mode: str, pd_routes: respx.MockRouter) -> None:
    other = "http://decode2.test:8300/v1"
    moved = pd_routes.post(f"{other}/chat/completions", name="decode2").mock(
        return_value=httpx.Response(200, json=chat_json("moved"))
    )
    twin = Twin(mode)
    copy = twin.client.with_options(decode_base_url=other)
    assert str(copy.base_url) == other + "/"
    completion = await twin.chat(copy, messages=MESSAGES)
    assert completion.choices[0].message.content == "moved" and moved.call_count == 1
    assert pd_routes["prefill"].call_count == 1 and pd_routes["decode"].call_count == 0


async def test_a_copy_with_other_pd_options_closes_cleanly(mode: str, pd_routes: respx.MockRouter) -> None:
    """A copy with other P/D options gets a transport of its own (on the same connections),
    built as the constructor builds one: it sends and closes as the original does."""
    twin = Twin(mode)
    copy = twin.client.with_options(dispatch="concurrent")
    assert copy._pd_transport is not twin.client._pd_transport
    assert copy.pd_options.dispatch == "concurrent" and copy.pd_fleet is twin.client.pd_fleet
    await twin.chat(copy, messages=MESSAGES)
    await twin.call(copy.close)
    assert copy.is_closed()
    await twin.close()


async def test_context_manager_and_close(mode: str, pd_routes: respx.MockRouter) -> None:
    if mode == "sync":
        with PDChatClient(prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="k") as client:
            client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        assert client.is_closed()
    else:
        async with AsyncPDChatClient(prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="k") as aclient:
            await aclient.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        assert aclient.is_closed()


async def test_other_requests_pass_through_to_decode(mode: str, pd_routes: respx.MockRouter) -> None:
    models = pd_routes.get(f"{DECODE}/models", name="models").mock(
        return_value=httpx.Response(
            200, json={"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "vllm"}]}
        )
    )
    embeddings = pd_routes.post(f"{DECODE}/embeddings", name="embeddings").mock(
        return_value=httpx.Response(
            200,
            json={
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}],
                "model": "m",
                "usage": {"prompt_tokens": 1, "total_tokens": 1},
            },
        )
    )
    twin = Twin(mode)
    listed = await twin.call(twin.client.models.list)
    if mode == "async":
        listed = [m async for m in listed]
    assert [m.id for m in listed] == ["m"]
    embedded = await twin.call(twin.client.embeddings.create, model="m", input="x")
    assert embedded.data[0].embedding == [0.5]
    assert json.loads(embeddings.calls[0].request.content)["input"] == "x"
    assert models.call_count == 1 and pd_routes["prefill"].call_count == 0


async def test_completions_forward_ids_as_the_decode_prompt(mode: str, pd_routes: respx.MockRouter) -> None:
    prefill = pd_routes.post(f"{PREFILL}/completions", name="prefill_cmpl").mock(
        side_effect=lambda r: httpx.Response(200, json=prefill_json(json.loads(r.content)))
    )
    decode = pd_routes.post(f"{DECODE}/completions", name="decode_cmpl").mock(
        return_value=httpx.Response(
            200,
            json={
                "id": "c",
                "object": "text_completion",
                "created": 1,
                "model": "m",
                "choices": [{"index": 0, "text": " there", "finish_reason": "stop"}],
            },
        )
    )
    twin = Twin(mode)
    completion = await twin.call(twin.client.completions.create, model="m", prompt="Hello", max_tokens=5)
    assert completion.choices[0].text == " there"
    assert body_of(prefill)["prompt"] == "Hello" and body_of(prefill)["max_tokens"] == 1
    assert body_of(decode) == {
        "model": "m",
        "prompt": ids_for("Hello"),
        "max_tokens": 5,
        "kv_transfer_params": NIXL_PARAMS,
    }
    await twin.call(twin.client.completions.create, model="m", prompt="Hello", max_tokens=5, echo=True)
    assert body_of(decode, 1)["prompt"] == "Hello", "echo needs the text prompt on decode"


async def test_media_parts_get_no_forwarded_ids(mode: str, pd_routes: respx.MockRouter) -> None:
    traces: list[PDTrace] = []
    twin = Twin(mode, on_trace=traces.append)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is P/D?"}, image]}]
    await twin.chat(messages=messages)
    decode = body_of(pd_routes["decode"])
    assert decode["kv_transfer_params"] == NIXL_PARAMS and decode["messages"] == messages
    assert traces[0].forwarded_tokens == 0 and traces[0].fallback == "ids not forwarded: media"


async def test_prefill_without_ids_still_decodes_correctly(mode: str, pd_routes: respx.MockRouter) -> None:
    payload = prefill_json({"messages": MESSAGES})
    del payload["prompt_token_ids"]
    pd_routes["prefill"].mock(return_value=httpx.Response(200, json=payload))
    traces: list[PDTrace] = []
    twin = Twin(mode, on_trace=traces.append)
    completion = await twin.chat(messages=MESSAGES)
    assert completion.choices[0].message.content == "echo:What is P/D?"
    assert body_of(pd_routes["decode"])["kv_transfer_params"] == NIXL_PARAMS
    assert traces[0].fallback == "ids not forwarded: prefill response has no prompt_token_ids"


async def test_prefill_without_connector_forwards_ids_alone(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["prefill"].mock(
        side_effect=lambda r: httpx.Response(200, json=prefill_json(json.loads(r.content), kv_params=None))
    )
    twin = Twin(mode)
    await twin.chat(messages=MESSAGES)
    assert body_of(pd_routes["decode"])["kv_transfer_params"] == {"prompt_token_ids": ids_for("What is P/D?")}


async def test_caller_kv_transfer_params_is_a_clear_400(mode: str, pd_routes: respx.MockRouter) -> None:
    twin = Twin(mode)
    with pytest.raises(openai.BadRequestError) as excinfo:
        await twin.chat(messages=MESSAGES, extra_body={"kv_transfer_params": {"do_remote_decode": True}})
    assert "kv_transfer_params is written by pdclient" in str(excinfo.value)
    assert pd_routes.calls.call_count == 0


async def test_batched_completions_prompt_is_a_clear_400(mode: str, pd_routes: respx.MockRouter) -> None:
    twin = Twin(mode)
    with pytest.raises(openai.BadRequestError) as excinfo:
        await twin.call(twin.client.completions.create, model="m", prompt=["a", "b"])
    assert "not a batch" in str(excinfo.value)


async def test_prefill_client_error_is_returned_as_is(mode: str, pd_routes: respx.MockRouter) -> None:
    error = {"error": {"message": "The model `nope` does not exist.", "type": "NotFoundError", "code": 404}}
    pd_routes["prefill"].mock(return_value=httpx.Response(404, json=error))
    twin = Twin(mode)
    with pytest.raises(openai.NotFoundError) as excinfo:
        await twin.chat(model="nope", messages=MESSAGES)
    assert "does not exist" in str(excinfo.value)
    assert status_error(excinfo).response.headers["x-pd-failed-leg"] == "prefill"
    assert pd_routes["decode"].call_count == 0


async def test_prefill_server_error_falls_back_to_decode_by_default(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["prefill"].mock(return_value=httpx.Response(500, json={"error": {"message": "boom"}}))
    traces: list[PDTrace] = []
    twin = Twin(mode, on_trace=traces.append)
    completion = await twin.chat(messages=MESSAGES)
    assert completion.choices[0].message.content == "echo:What is P/D?"
    assert "kv_transfer_params" not in body_of(pd_routes["decode"])
    assert traces[0].fallback is not None and traces[0].fallback.startswith("prefill failed, decode-only: HTTP 500")


async def test_prefill_failure_with_fail_policy_raises(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["prefill"].mock(side_effect=httpx.ConnectError("refused"))
    twin = Twin(mode, on_prefill_failure="fail")
    with pytest.raises(openai.APIStatusError) as excinfo:
        await twin.chat(messages=MESSAGES)
    error = status_error(excinfo)
    assert error.status_code == 502 and "prefill leg failed: ConnectError: refused" in str(error)
    assert error.response.headers["x-pd-failed-leg"] == "prefill"
    assert pd_routes["decode"].call_count == 0


def _sent_through_sync_transport(options: PDOptions, body: bytes, extensions: dict[str, Any]) -> httpx.Response:
    with httpx.Client(transport=PDTransport(options=options)) as http:
        request = http.build_request("POST", DECODE + "/chat/completions", content=body, extensions=extensions)
        response = http.send(request)
        response.read()
        return response


@pytest.mark.parametrize("decode_status", [200, 400])
async def test_a_server_passing_requests_on_can_decline_the_trace_headers(
    mode: str, pd_routes: respx.MockRouter, decode_status: int
) -> None:
    """``pdclient serve`` drops them unless asked, so it asks the transport not to build them;
    an answer whose decode failed keeps them, the failed leg's among them."""
    if decode_status != 200:
        pd_routes["decode"].mock(return_value=httpx.Response(decode_status, json={"error": {"message": "bad"}}))
    options = PDOptions(prefill_base_url=PREFILL, decode_base_url=DECODE)
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    extensions: dict[str, Any] = {TRACE_HEADERS_EXTENSION: False}
    if mode == "sync":
        response = _sent_through_sync_transport(options, body, extensions)
    else:
        async with httpx.AsyncClient(transport=AsyncPDTransport(options=options)) as http:
            request = http.build_request("POST", DECODE + "/chat/completions", content=body, extensions=extensions)
            response = await http.send(request)
    trace_headers = {name: value for name, value in response.headers.items() if name.startswith("x-pd-")}
    assert response.status_code == decode_status
    if decode_status == 200:
        assert trace_headers == {} and response.json()["choices"][0]["message"]["content"] == "echo:What is P/D?"
    else:
        assert trace_headers["x-pd-failed-leg"] == "decode"


async def test_decode_error_status_reaches_the_caller(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["decode"].mock(
        return_value=httpx.Response(400, json={"error": {"message": "kv_transfer_params.prompt_token_ids: bad"}})
    )
    twin = Twin(mode)
    with pytest.raises(openai.BadRequestError) as excinfo:
        await twin.chat(messages=MESSAGES)
    assert status_error(excinfo).response.headers["x-pd-failed-leg"] == "decode"


def test_clients_are_openai_clients() -> None:
    sync = PDChatClient(prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="k")
    aclient = AsyncPDChatClient(prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="k")
    assert isinstance(sync, openai.OpenAI) and isinstance(aclient, openai.AsyncOpenAI)
    assert str(sync.base_url) == DECODE + "/" and str(aclient.base_url) == DECODE + "/"


async def test_own_openai_client_with_the_public_transport(mode: str, pd_routes: respx.MockRouter) -> None:
    from pdclient import AsyncPDTransport, PDTransport

    client: Any
    if mode == "sync":
        client = openai.OpenAI(
            base_url=DECODE, api_key="k", http_client=httpx.Client(transport=PDTransport(PREFILL, DECODE))
        )
        completion = client.chat.completions.create(model="m", messages=MESSAGES)
    else:
        http = httpx.AsyncClient(transport=AsyncPDTransport(PREFILL, DECODE))
        client = openai.AsyncOpenAI(base_url=DECODE, api_key="k", http_client=http)
        completion = await client.chat.completions.create(model="m", messages=MESSAGES)
    assert completion.choices[0].message.content == "echo:What is P/D?"
    assert "prompt_token_ids" in body_of(pd_routes["decode"])["kv_transfer_params"]
