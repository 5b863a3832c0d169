"""OpenTelemetry: one logical call stays one call, and pdclient's own optional spans.

- opentelemetry-instrumentation-openai-v2 (the official openai instrumentation) patches the
  SDK's ``Completions.create``; the P/D split happens below it, in the transport, so it
  records exactly one ``chat <model>`` span per call, streamed or not.
- ``pdclient.otel.instrument(client)`` (the ``pdclient[otel]`` extra) adds a
  ``pdclient.chat`` span per call with ``pdclient.prefill`` / ``pdclient.decode`` children
  and the PDTrace fields as attributes, nested under the generation span when both are on.
- Without the extra nothing imports OpenTelemetry.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdclient import AsyncPDChatClient, AsyncPDTransport, PDChatClient, PDConfigError, PDTransport
from pdclient.otel import instrument

from .conftest import DECODE, MODEL, PREFILL, FakePair

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def exporter() -> Iterator[tuple[TracerProvider, InMemorySpanExporter]]:
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    yield provider, spans
    provider.shutdown()


@pytest.fixture
def genai(exporter: tuple[TracerProvider, InMemorySpanExporter]) -> Iterator[InMemorySpanExporter]:
    """The official openai instrumentation, on for one test."""
    instrumentation = pytest.importorskip("opentelemetry.instrumentation.openai_v2")
    instrumentor = instrumentation.OpenAIInstrumentor()
    instrumentor.instrument(tracer_provider=exporter[0])
    yield exporter[1]
    instrumentor.uninstrument()


def generations(spans: InMemorySpanExporter) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if (s.attributes or {}).get("gen_ai.operation.name") == "chat"]


def pd_spans(spans: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [s for s in spans.get_finished_spans() if s.name == name]


def sync_client(provider: TracerProvider | None = None, **kwargs: Any) -> PDChatClient:
    client = PDChatClient(prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="EMPTY", **kwargs)
    return client if provider is None else instrument(client, tracer_provider=provider)


def async_client(provider: TracerProvider | None = None, **kwargs: Any) -> AsyncPDChatClient:
    client = AsyncPDChatClient(prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="EMPTY", **kwargs)
    return client if provider is None else instrument(client, tracer_provider=provider)


# -- the official openai instrumentation sees one call --------------------------------


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_one_generation_per_call(fake_pair: FakePair, genai: InMemorySpanExporter, stream: bool) -> None:
    client = sync_client()
    for _ in range(3):
        response = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)  # type: ignore[call-overload]
        if stream:
            text = "".join(chunk.choices[0].delta.content or "" for chunk in response if chunk.choices)
        else:
            text = response.choices[0].message.content
        assert text == fake_pair.answer
    fake_pair.assert_handoffs(3)  # six HTTP requests ...
    spans = generations(genai)
    assert len(spans) == 3  # ... three generations
    assert all(s.attributes["gen_ai.request.model"] == MODEL for s in spans)  # type: ignore[index]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_one_generation_per_call_async(fake_pair: FakePair, genai: InMemorySpanExporter, stream: bool) -> None:
    client = async_client()
    for _ in range(3):
        response = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)  # type: ignore[call-overload]
        if stream:
            async for _chunk in response:
                pass
    fake_pair.assert_handoffs(3)
    assert len(generations(genai)) == 3


def test_generation_and_pdclient_spans_nest(
    fake_pair: FakePair, genai: InMemorySpanExporter, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    sync_client(exporter[0]).chat.completions.create(model=MODEL, messages=MESSAGES)
    (generation,) = generations(genai)
    (call,) = pd_spans(genai, "pdclient.chat")
    assert call.parent is not None and call.parent.span_id == generation.context.span_id
    assert call.context.trace_id == generation.context.trace_id


# -- pdclient's own spans ---------------------------------------------------------------


def check_call_spans(spans: InMemorySpanExporter, calls: int) -> None:
    chat = pd_spans(spans, "pdclient.chat")
    assert len(chat) == calls
    for call in chat:
        children = [s for s in spans.get_finished_spans() if s.parent and s.parent.span_id == call.context.span_id]
        assert [s.name for s in children] == ["pdclient.prefill", "pdclient.decode"]
        assert all(s.kind is SpanKind.CLIENT for s in children)
        assert children[0].attributes["url.full"] == f"{PREFILL}/chat/completions"  # type: ignore[index]
        assert children[1].attributes["url.full"] == f"{DECODE}/chat/completions"  # type: ignore[index]
        assert all(s.attributes["http.response.status_code"] == 200 for s in children)  # type: ignore[index]
        # The legs lie inside the call, in order.
        prefill, decode = children
        assert call.start_time <= prefill.start_time <= prefill.end_time <= decode.start_time  # type: ignore[operator]
        assert decode.end_time <= call.end_time  # type: ignore[operator]
        attrs = call.attributes or {}
        assert attrs["pdclient.route"] == "chat"
        assert attrs["pdclient.prefill_url"] == PREFILL and attrs["pdclient.decode_url"] == DECODE
        assert attrs["pdclient.forwarded_tokens"] > 0  # type: ignore[operator]
        assert attrs["pdclient.prefill_ms"] >= 0 and attrs["pdclient.decode_first_byte_ms"] >= 0  # type: ignore[operator]
        assert str(attrs["pdclient.request_id"]).startswith("pd-") or attrs["pdclient.request_id"]
        assert "pdclient.fallback" not in attrs
        assert call.status.status_code is StatusCode.UNSET


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
def test_pdclient_spans(
    fake_pair: FakePair, exporter: tuple[TracerProvider, InMemorySpanExporter], stream: bool
) -> None:
    client = sync_client(exporter[0])
    for _ in range(2):
        response = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)  # type: ignore[call-overload]
        if stream:
            for _chunk in response:
                pass
    check_call_spans(exporter[1], 2)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
async def test_pdclient_spans_async(
    fake_pair: FakePair, exporter: tuple[TracerProvider, InMemorySpanExporter], stream: bool
) -> None:
    client = async_client(exporter[0])
    for _ in range(2):
        response = await client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=stream)  # type: ignore[call-overload]
        if stream:
            async for _chunk in response:
                pass
    check_call_spans(exporter[1], 2)


def test_pdclient_spans_on_a_plain_openai_client(
    fake_pair: FakePair, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """instrument() also takes the httpx client of the PDTransport recipe."""
    import openai

    http = instrument(
        httpx.Client(transport=PDTransport(prefill_base_url=PREFILL, decode_base_url=DECODE)),
        tracer_provider=exporter[0],
    )
    openai.OpenAI(base_url=DECODE, api_key="EMPTY", http_client=http).chat.completions.create(  # type: ignore[arg-type]
        model=MODEL, messages=MESSAGES
    )
    check_call_spans(exporter[1], 1)


async def test_instrument_async_http_client(
    fake_pair: FakePair, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    import openai

    http = instrument(
        httpx.AsyncClient(transport=AsyncPDTransport(prefill_base_url=PREFILL, decode_base_url=DECODE)),
        tracer_provider=exporter[0],
    )
    client = openai.AsyncOpenAI(base_url=DECODE, api_key="EMPTY", http_client=http)  # type: ignore[arg-type]
    await client.chat.completions.create(model=MODEL, messages=MESSAGES)
    check_call_spans(exporter[1], 1)


def test_fallback_and_retries_show_in_spans(
    prefill_down: FakePair, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    """Each prefill attempt is a failed child span; the call span carries the fallback."""
    sync_client(exporter[0]).chat.completions.create(model=MODEL, messages=MESSAGES)
    (call,) = pd_spans(exporter[1], "pdclient.chat")
    prefills = pd_spans(exporter[1], "pdclient.prefill")
    assert len(prefills) == 3  # RetrySettings.prefill_attempts
    assert all(s.status.status_code is StatusCode.ERROR and s.events[0].name == "exception" for s in prefills)
    (decode,) = pd_spans(exporter[1], "pdclient.decode")
    assert decode.status.status_code is StatusCode.UNSET
    attrs = call.attributes or {}
    assert str(attrs["pdclient.fallback"]).startswith("prefill failed, decode-only")
    assert attrs["pdclient.forwarded_tokens"] == 0


def test_decode_error_marks_the_call(
    fake_pair: FakePair, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    import openai

    fake_pair.router.routes["decode"].mock(return_value=httpx.Response(400, json={"error": {"message": "bad"}}))
    with pytest.raises(openai.BadRequestError):
        sync_client(exporter[0], max_retries=0).chat.completions.create(model=MODEL, messages=MESSAGES)
    (call,) = pd_spans(exporter[1], "pdclient.chat")
    assert call.status.status_code is StatusCode.ERROR
    assert (call.attributes or {})["pdclient.failed_leg"] == "decode"


def test_no_spans_for_passthrough_requests(
    fake_pair: FakePair, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    sync_client(exporter[0]).models.list()
    assert exporter[1].get_finished_spans() == ()


def test_instrument_is_idempotent_and_survives_with_options(
    fake_pair: FakePair, exporter: tuple[TracerProvider, InMemorySpanExporter]
) -> None:
    client = sync_client(exporter[0])
    assert instrument(client, tracer_provider=exporter[0]) is client
    client.with_options(timeout=30).chat.completions.create(model=MODEL, messages=MESSAGES)
    check_call_spans(exporter[1], 1)


def test_instrument_rejects_other_clients() -> None:
    import openai

    with pytest.raises(PDConfigError, match="PDChatClient"):
        instrument(openai.OpenAI(base_url=DECODE, api_key="EMPTY"))


# -- without the extra --------------------------------------------------------------------


def run_isolated(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=False
    )


def test_no_opentelemetry_import_unless_enabled() -> None:
    result = run_isolated(
        f"""
        import sys, respx, httpx
        import pdclient, pdclient.otel
        from pdclient import PDChatClient
        with respx.mock:
            respx.post("{PREFILL}/chat/completions").mock(return_value=httpx.Response(
                200, json={{"choices": [], "prompt_token_ids": [1, 2], "kv_transfer_params": None}}))
            respx.post("{DECODE}/chat/completions").mock(return_value=httpx.Response(200, json={{
                "id": "x", "object": "chat.completion", "created": 1, "model": "m",
                "choices": [{{"index": 0, "finish_reason": "stop",
                              "message": {{"role": "assistant", "content": "hi"}}}}]}}))
            client = PDChatClient(prefill_base_url="{PREFILL}", decode_base_url="{DECODE}", api_key="x")
            client.chat.completions.create(model="m", messages=[{{"role": "user", "content": "hi"}}])
        print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_instrument_without_opentelemetry_says_what_to_install() -> None:
    result = run_isolated(
        f"""
        import sys
        sys.modules["opentelemetry"] = None  # as if the extra were not installed
        from pdclient import PDChatClient
        from pdclient.otel import instrument
        try:
            instrument(PDChatClient(prefill_base_url="{PREFILL}", decode_base_url="{DECODE}", api_key="x"))
        except ImportError as exc:
            print(exc)
        """
    )
    assert result.returncode == 0, result.stderr
    assert "pip install 'pdclient[otel]'" in result.stdout
