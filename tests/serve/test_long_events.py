"""``pdclient serve`` passes a streamed answer on in whole events, however long, up to
``wire.MAX_EVENT_BYTES``; past it the caller's stream ends with an error event naming the
bound, and the proxy logs the call's failure, no traceback."""

from __future__ import annotations

import openai
import pytest

from pdclient.dialects import endpoint_tag
from pdclient.wire import MAX_EVENT_BYTES
from tests.responses_stub import PREFILL_USAGE, ResponsesStub
from tests.serve.conftest import ServeProcess

INSTRUCTIONS = "Answer briefly, in the caller's language. " * 2500  # 105 KB, in every lifecycle event
LIFECYCLE = ("response.created", "response.in_progress", "response.completed")


def test_serve_tags_and_merges_long_responses_events_whole() -> None:
    with ResponsesStub() as stub:
        serve = ServeProcess("--prefill", stub.url, "--decode", stub.url)
        try:
            client = openai.OpenAI(base_url=serve.url + "/v1", api_key="-", max_retries=0)
            with client.responses.stream(model="m", input="hi", instructions=INSTRUCTIONS) as stream:
                events = list(stream)
                final = stream.get_final_response()
            tagged = f"{stub.stored[-1]}.pd{endpoint_tag(stub.url)}"
            lifecycle = [e for e in events if e.type in LIFECYCLE]
            assert [e.response.id for e in lifecycle] == [tagged] * 3
            assert final.usage is not None and final.usage.input_tokens == PREFILL_USAGE["input_tokens"]
            follow_up = client.responses.create(model="m", input="and?", previous_response_id=final.id)
            assert follow_up.previous_response_id == tagged
        finally:
            serve.stop()
    assert "Traceback" not in serve.stderr()


def test_serve_ends_a_stream_whose_event_passes_the_bound_with_an_error_naming_it() -> None:
    with ResponsesStub(padding=MAX_EVENT_BYTES) as stub:
        serve = ServeProcess("--prefill", stub.url, "--decode", stub.url)
        try:
            client = openai.OpenAI(base_url=serve.url + "/v1", api_key="-", max_retries=0)
            with (
                pytest.raises(openai.APIError, match=r"longer than 16 MiB"),
                client.responses.stream(model="m", input="hi") as stream,
            ):
                list(stream)
        finally:
            serve.stop()
    log = serve.stderr()
    assert "Traceback" not in log and "16 MiB" in log
