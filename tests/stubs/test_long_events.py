"""A streamed answer's events are handled whole, however many network reads each takes, up to
``wire.MAX_EVENT_BYTES``; past it the stream ends with an error naming the bound.

A Responses answer echoes its ``instructions`` in each lifecycle event: with 100 KB of
them, every such event still gets its endpoint's tag in its ids and the prefill's usage.
"""

from __future__ import annotations

from typing import Any

import openai
import pytest

from pdclient import PDTrace
from pdclient.dialects import endpoint_tag
from pdclient.wire import MAX_EVENT_BYTES
from tests.responses_stub import PREFILL_USAGE, TEXT, ResponsesStub
from tests.twins import Twin

INSTRUCTIONS = "Answer briefly, in the caller's language. " * 2500  # 105 KB, in every lifecycle event
LIFECYCLE = ("response.created", "response.in_progress", "response.completed")


async def _stream(t: Twin, **request: Any) -> tuple[list[Any], Any]:
    """The events of ``responses.stream()``, and its final response."""
    if t.mode == "sync":
        with t.client.responses.stream(**request) as stream:  # type: ignore[union-attr]
            return list(stream), stream.get_final_response()
    async with t.client.responses.stream(**request) as astream:  # type: ignore[union-attr]
        return [event async for event in astream], await astream.get_final_response()


async def test_long_responses_events_are_tagged_and_merged_whole(mode: str) -> None:
    traces: list[PDTrace] = []
    with ResponsesStub() as stub:
        t = Twin(mode, prefill_base_url=stub.url, decode_base_url=stub.url, on_trace=traces.append)
        events, final = await _stream(t, model="m", input="hi", instructions=INSTRUCTIONS)
        tagged = f"{stub.stored[-1]}.pd{endpoint_tag(stub.url)}"
        lifecycle = [e for e in events if e.type in LIFECYCLE]
        assert [e.response.id for e in lifecycle] == [tagged] * 3
        assert all(e.response.instructions == INSTRUCTIONS for e in lifecycle)
        assert final.id == tagged and final.output_text == "".join(TEXT)
        assert final.usage is not None and final.usage.input_tokens == PREFILL_USAGE["input_tokens"]
        assert traces[-1].outcome.value == "disaggregated"
        follow_up = await t.call(t.client.responses.create, model="m", input="and?", previous_response_id=final.id)
        assert stub.decode_bodies[-1]["previous_response_id"] == stub.stored[-2]
        assert follow_up.previous_response_id == tagged
        await t.close()


async def test_an_event_longer_than_the_bound_ends_the_stream_with_an_error_naming_it(mode: str) -> None:
    traces: list[PDTrace] = []
    with ResponsesStub(padding=MAX_EVENT_BYTES) as stub:
        t = Twin(mode, prefill_base_url=stub.url, decode_base_url=stub.url, on_trace=traces.append)
        with pytest.raises(openai.APIError, match=r"longer than 16 MiB") as excinfo:
            await _stream(t, model="m", input="hi")
        assert "MAX_EVENT_BYTES" in str(excinfo.value)
        assert traces[-1].outcome.value == "failed" and "16 MiB" in (traces[-1].error or "")
        await t.close()
