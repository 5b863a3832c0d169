"""Issue 13's client items, each as it was found: a test per item, sync and async where both exist.

Every test here failed before its fix (item numbers as in the issue).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import respx

from pdclient import AsyncPDChatClient, Outcome, PDChatClient, PDConfigError, PDTrace, RetrySettings
from tests.fake_vllm import DECODE, PREFILL, chat_chunk, chat_json, ids_for, prefill_json
from tests.twins import Twin, status_error

MESSAGES = [{"role": "user", "content": "Is it up?"}]
FAST = RetrySettings(backoff_initial=0.001, backoff_max=0.01)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def traced(mode: str, **kwargs: Any) -> tuple[Twin, list[PDTrace]]:
    traces: list[PDTrace] = []
    kwargs.setdefault("retries", FAST)
    return Twin(mode, on_trace=traces.append, **kwargs), traces


def in_flight(twin: Twin) -> list[int]:
    fleet = twin.client.pd_fleet
    return [e.in_flight for e in (*fleet.prefill.endpoints, *fleet.decode.endpoints)]


# -- 6: a non-ASCII prefill error --------------------------------------------------------------


@pytest.mark.parametrize("policy", ["decode", "fail"])
async def test_6_non_ascii_prefill_error_is_an_ordinary_outcome(
    mode: str, pd_routes: respx.MockRouter, policy: str
) -> None:
    pd_routes["prefill"].mock(
        return_value=httpx.Response(503, json={"error": {"message": "Modèle surchargé — réessayez"}})
    )
    twin, traces = traced(mode, on_prefill_failure=policy)
    if policy == "decode":
        completion = await twin.chat(messages=MESSAGES)
        assert completion.choices[0].message.content == "echo:Is it up?"
        assert traces[0].outcome is Outcome.PREFILL_FAILED and "Modèle surchargé" in (traces[0].fallback or "")
    else:
        with pytest.raises(openai.InternalServerError) as excinfo:
            await twin.chat(messages=MESSAGES)
        headers = status_error(excinfo).response.headers
        assert headers["x-pd-failed-leg"] == "prefill"
        assert "Mod\\xe8le surcharg\\xe9" in headers["x-pd-error"], "escaped to ASCII in the header"
        assert "Modèle surchargé" in (traces[0].error or ""), "whole in the trace"
    assert in_flight(twin) == [0, 0]
    await twin.close()


async def test_6_non_ascii_failure_policy_is_a_clear_error(mode: str, pd_routes: respx.MockRouter) -> None:
    with pytest.raises(PDConfigError, match="on_prefill_failure must be one of"):
        Twin(mode, on_prefill_failure="décode")
    twin, traces = traced(mode)
    with pytest.raises(openai.BadRequestError, match=r"pdclient\.on_prefill_failure must be one of"):
        await twin.chat(messages=MESSAGES, extra_body={"pdclient": {"on_prefill_failure": "décode"}})
    assert traces[0].outcome is Outcome.REFUSED and pd_routes["prefill"].call_count == 0
    await twin.close()


async def test_6_a_response_that_cannot_be_wrapped_is_closed(
    mode: str, pd_routes: respx.MockRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever goes wrong while wrapping the decode response, its connection and endpoint are freed."""
    closed: list[bool] = []

    class Body(httpx.SyncByteStream, httpx.AsyncByteStream):
        def __iter__(self) -> Iterator[bytes]:
            yield b"{}"

        async def __aiter__(self) -> Any:
            yield b"{}"

        def close(self) -> None:
            closed.append(True)

        async def aclose(self) -> None:
            closed.append(True)

    def broken(self: PDTrace) -> dict[str, str]:
        raise RuntimeError("cannot write the trace headers")

    pd_routes["decode"].mock(return_value=httpx.Response(200, stream=Body()))
    monkeypatch.setattr(PDTrace, "to_headers", broken)
    twin, traces = traced(mode)
    # openai 3.x lets the transport's exception through; 2.x wraps it in APIConnectionError.
    with pytest.raises((RuntimeError, openai.APIConnectionError)) as raised:
        await twin.chat(messages=MESSAGES)
    cause = raised.value if isinstance(raised.value, RuntimeError) else raised.value.__cause__
    assert "cannot write the trace headers" in str(cause)
    assert closed and in_flight(twin) == [0, 0]
    assert traces[0].outcome is Outcome.FAILED
    await twin.close()


# -- 7: multipart pass-through ------------------------------------------------------------------


async def test_7_multipart_pass_through(mode: str, pd_routes: respx.MockRouter) -> None:
    files = pd_routes.post(f"{DECODE}/files").mock(
        return_value=httpx.Response(
            200,
            json={
                "id": "file-1",
                "object": "file",
                "bytes": 5,
                "created_at": 1,
                "filename": "a.jsonl",
                "purpose": "batch",
                "status": "processed",
            },
        )
    )
    audio = pd_routes.post(f"{DECODE}/audio/transcriptions").mock(return_value=httpx.Response(200, json={"text": "hi"}))
    twin = Twin(mode)
    created = await twin.call(twin.client.files.create, file=("a.jsonl", b"{}\n{}\n"), purpose="batch")
    assert created.id == "file-1"
    transcript = await twin.call(twin.client.audio.transcriptions.create, model="w", file=("a.wav", b"RIFF...."))
    assert transcript.text == "hi"
    assert b'filename="a.jsonl"' in files.calls[0].request.read()
    assert b"RIFF...." in audio.calls[0].request.read()
    await twin.close()


# -- 8: pass-through timeouts ---------------------------------------------------------------------


async def test_8_pass_through_keeps_the_callers_timeout(mode: str, pd_routes: respx.MockRouter) -> None:
    models = pd_routes.get(f"{DECODE}/models").mock(return_value=httpx.Response(200, json={"data": []}))
    twin = Twin(mode, retries=RetrySettings(prefill_timeout=1.0))
    await twin.call(twin.client.models.list, timeout=120)
    assert models.calls[0].request.extensions["timeout"]["read"] == 120
    await twin.close()


# -- 9: [DONE], then a dropped connection -----------------------------------------------------------


@pytest.mark.parametrize("split", [0, 9], ids=["done_whole", "done_split_across_reads"])
async def test_9_done_then_dropped_connection_keeps_the_answer(
    mode: str, pd_routes: respx.MockRouter, split: int
) -> None:
    def body() -> Iterator[bytes]:
        end = chat_chunk("Hel") + chat_chunk("lo") + b"data: [DONE]\n\n"
        cut = len(end) - split  # a network read may end inside the last event
        yield end[:cut]
        if split:
            yield end[cut:]
        raise httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    async def abody() -> Any:
        for chunk in body():
            yield chunk

    pd_routes["decode"].mock(
        return_value=httpx.Response(
            200, stream=abody() if mode == "async" else body(), headers={"content-type": "text/event-stream"}
        )  # type: ignore[arg-type]
    )
    twin, traces = traced(mode)
    assert "".join(await twin.stream_text(messages=MESSAGES)) == "Hello"
    assert traces[0].outcome is Outcome.DISAGGREGATED and traces[0].error is None
    await twin.close()


# -- 10: trio ------------------------------------------------------------------------------------


def test_10_async_client_under_trio_cancel_and_unreachable_decode(pd_routes: respx.MockRouter) -> None:
    trio = pytest.importorskip("trio")
    releases: list[dict[str, Any]] = []

    async def held_decode(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("max_tokens") == 1:
            releases.append(body)
            return httpx.Response(200, json=chat_json("released"))
        await trio.sleep(3600)
        raise AssertionError("not reached")

    async def main() -> None:
        client = AsyncPDChatClient(prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="k", max_retries=0)
        pd_routes["decode"].mock(side_effect=held_decode)
        with trio.move_on_after(0.5):
            await client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        pd_routes["decode"].mock(side_effect=httpx.ConnectError("unreachable"))
        with pytest.raises(openai.APIConnectionError):
            await client.chat.completions.create(model="m", messages=MESSAGES)  # type: ignore[arg-type]
        await client.close()

    trio.run(main)
    assert len(releases) == 1 and releases[0]["kv_transfer_params"]["prompt_token_ids"] == ids_for("Is it up?")


# -- 13: out-of-range Retry-After ------------------------------------------------------------------


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
async def test_13_out_of_range_retry_after_ms_is_ignored(mode: str, pd_routes: respx.MockRouter, value: str) -> None:
    busy = httpx.Response(429, headers={"retry-after-ms": value}, json={"error": {"message": "busy"}})
    pd_routes["prefill"].mock(side_effect=[busy, httpx.Response(200, json=prefill_json({"messages": MESSAGES}))])
    twin, traces = traced(mode)
    await twin.chat(messages=MESSAGES)
    assert traces[0].prefill_attempts == 2 and traces[0].outcome is Outcome.DISAGGREGATED
    await twin.close()


# -- 14: per-call options -----------------------------------------------------------------------


async def test_14_call_options_never_reach_the_fallback_server(mode: str, pd_routes: respx.MockRouter) -> None:
    fallback = "http://unified.test:8000/v1"
    unified = pd_routes.post(f"{fallback}/chat/completions").mock(return_value=httpx.Response(200, json=chat_json("u")))
    pd_routes["prefill"].mock(side_effect=httpx.ConnectError("down"))
    twin, _ = traced(mode)
    await twin.chat(messages=MESSAGES, extra_body={"pdclient": {"on_prefill_failure": fallback, "session": "s"}})
    assert unified.call_count == 1 and b"pdclient" not in unified.calls[0].request.content
    await twin.close()


async def test_14_call_options_never_reach_a_pass_through_server(mode: str, pd_routes: respx.MockRouter) -> None:
    embeddings = pd_routes.post(f"{DECODE}/embeddings").mock(
        return_value=httpx.Response(
            200,
            json={
                "object": "list",
                "data": [{"object": "embedding", "index": 0, "embedding": [0.5]}],
                "model": "e",
                "usage": {"prompt_tokens": 1, "total_tokens": 1},
            },
        )
    )
    twin = Twin(mode)
    await twin.call(twin.client.embeddings.create, model="e", input="hi", extra_body={"pdclient": {"session": "s"}})
    sent = json.loads(embeddings.calls[0].request.content)
    assert "pdclient" not in sent and sent["input"] == "hi"
    await twin.close()


@pytest.mark.parametrize("route", ["chat", "embeddings"])
async def test_14_misspelt_call_option_is_a_400_naming_it(mode: str, pd_routes: respx.MockRouter, route: str) -> None:
    pd_routes.post(f"{DECODE}/embeddings").mock(return_value=httpx.Response(200, json={}))
    twin = Twin(mode)
    options = {"extra_body": {"pdclient": {"on_prefil_failure": "fail"}}}
    with pytest.raises(openai.BadRequestError, match=r"pdclient\.on_prefil_failure is not a per-call option"):
        if route == "chat":
            await twin.chat(messages=MESSAGES, **options)
        else:
            await twin.call(twin.client.embeddings.create, model="e", input="x", **options)
    assert pd_routes["prefill"].call_count == 0 and pd_routes["decode"].call_count == 0
    await twin.close()


# -- 15: a server's own x-pd-* headers ----------------------------------------------------------------


async def test_15_server_trace_headers_do_not_leak(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["decode"].mock(
        return_value=httpx.Response(
            200,
            json=chat_json("ok"),
            headers={"x-pd-fallback": "evil", "x-pd-decode-first-byte-ms": "abc", "x-pd-prefill-url": "http://x"},
        )
    )
    twin, traces = traced(mode)
    raw = await twin.call(twin.client.chat.completions.with_raw_response.create, model="m", messages=MESSAGES)
    trace = PDTrace.from_headers(raw.headers)
    assert trace.fallback is None and trace.prefill_url == PREFILL and raw.headers.get("x-pd-fallback") is None
    assert traces[0].fallback is None
    assert PDTrace.from_headers({"x-pd-decode-first-byte-ms": "abc", "x-pd-route": "chat"}).route == "chat"
    await twin.close()


async def test_15_a_server_header_beyond_ascii_reaches_the_caller_as_it_came(
    mode: str, pd_routes: respx.MockRouter
) -> None:
    """Dropping the servers' x-pd-* headers rebuilt them as str, which httpx encodes as ASCII:
    a UTF-8 header from the decode server was a crash."""
    note = "Zoë".encode()
    pd_routes["decode"].mock(return_value=httpx.Response(200, json=chat_json("ok"), headers=[(b"x-note", note)]))
    twin, traces = traced(mode)
    raw = await twin.call(twin.client.chat.completions.with_raw_response.create, model="m", messages=MESSAGES)
    assert raw.headers.raw[[k for k, _ in raw.headers.raw].index(b"x-note")][1] == note
    assert traces[0].outcome is Outcome.DISAGGREGATED
    await twin.close()


# -- 17: an undecodable prefill body --------------------------------------------------------------


async def test_17_undecodable_prefill_body_follows_the_failure_policy(mode: str, pd_routes: respx.MockRouter) -> None:
    pd_routes["prefill"].mock(
        side_effect=lambda request: httpx.Response(
            200, stream=httpx.ByteStream(b'{"not": "gzip"}'), headers={"content-encoding": "gzip"}
        )
    )
    twin, traces = traced(mode)
    completion = await twin.chat(messages=MESSAGES)
    assert completion.choices[0].message.content == "echo:Is it up?"
    assert pd_routes["prefill"].call_count == 3, "retried like any failed attempt"
    assert traces[0].outcome is Outcome.PREFILL_FAILED and "DecodingError" in (traces[0].fallback or "")
    assert in_flight(twin) == [0, 0]
    await twin.close()


# -- 18: the caller's body reaches the servers unchanged ------------------------------------------


async def test_18_big_integers_reach_both_legs_unchanged(mode: str, pd_routes: respx.MockRouter) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "integer", "maximum": 10**20}}}
    twin = Twin(mode)
    await twin.chat(messages=MESSAGES, tools=[tool])
    for route in ("prefill", "decode"):
        assert b'"maximum":100000000000000000000' in pd_routes[route].calls[0].request.content
    await twin.close()


def test_the_clients_are_the_same_type_across_copies() -> None:
    client = PDChatClient(prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="k")
    assert type(client.with_options(timeout=3)) is PDChatClient
