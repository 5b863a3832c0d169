"""A stored response's decode endpoint, found from its id alone (respx, two decode endpoints).

Each fake decode server keeps the responses it answered, as vLLM with
``VLLM_ENABLE_RESPONSES_API_STORE=1`` does, and answers 404 for an id it does not hold,
so a follow-up that reached the wrong endpoint fails here as it would on real servers.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import respx

from pdclient import Outcome, PDTrace
from pdclient.dialects import endpoint_tag
from tests.fake_vllm import DECODE, DECODE2, NIXL_PARAMS, PREFILL
from tests.twins import Twin

Body = dict[str, Any]
GONE = "http://decode-gone.test:8200/v1"


def _response(response_id: str, previous: str | None, status: str = "completed") -> Body:
    item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed"}
    item["content"] = [{"type": "output_text", "text": "Hi", "annotations": []}]
    return {
        "id": response_id,
        "object": "response",
        "created_at": 1,
        "model": "m",
        "status": status,
        "output": [item],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "previous_response_id": previous,
        "usage": {
            "input_tokens": 3,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": 1,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 4,
        },
    }


def _missing(response_id: str) -> httpx.Response:
    error = {"message": f"Response with id '{response_id}' not found.", "type": "invalid_request_error"}
    return httpx.Response(404, json={"error": error})


@dataclass
class StoringDecodes:
    """Two decode servers that store what they answer, and a prefill; records every request."""

    stored: dict[str, set[str]] = field(default_factory=lambda: {DECODE: set(), DECODE2: set()})
    bodies: list[tuple[str, Body]] = field(default_factory=list)
    paths: list[tuple[str, str]] = field(default_factory=list)
    raw_streams: list[bytes] = field(default_factory=list)
    _ids: Iterator[int] = field(default_factory=itertools.count)

    def prefill(self, request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={**_response("resp_p", None), "kv_transfer_params": {**NIXL_PARAMS, "prompt_token_ids": [1, 2, 3]}},
        )

    def create(self, base: str) -> Any:
        def answer(request: httpx.Request) -> httpx.Response:
            body = json.loads(request.content)
            self.bodies.append((base, body))
            previous = body.get("previous_response_id")
            if previous is not None and previous not in self.stored[base]:
                return _missing(previous)
            response_id = f"resp_{next(self._ids):032x}"
            self.stored[base].add(response_id)
            done = _response(response_id, previous)
            if not body.get("stream"):
                return httpx.Response(200, json=done)
            events = [
                {"type": "response.created", "response": {**done, "status": "in_progress"}},
                {"type": "response.output_text.delta", "item_id": "msg_1", "output_index": 0, "content_index": 0}
                | {"delta": "Hi", "logprobs": []},
                {"type": "response.completed", "response": done},
            ]
            raw = b"".join(
                f"event: {e['type']}\ndata: {json.dumps({**e, 'sequence_number': n})}\n\n".encode()
                for n, e in enumerate(events)
            )
            self.raw_streams.append(raw)
            return httpx.Response(200, content=raw, headers={"content-type": "text/event-stream"})

        return answer

    def retrieve(self, base: str) -> Any:
        def answer(request: httpx.Request) -> httpx.Response:
            self.paths.append((base, request.url.path))
            response_id = request.url.path.split("/")[3]
            if response_id not in self.stored[base]:
                return _missing(response_id)
            status = "cancelled" if request.url.path.endswith("/cancel") else "completed"
            return httpx.Response(200, json=_response(response_id, None, status))

        return answer


@pytest.fixture
def servers() -> Iterator[StoringDecodes]:
    fake = StoringDecodes()
    with respx.mock(assert_all_called=False) as router:
        router.post(f"{PREFILL}/responses").mock(side_effect=fake.prefill)
        for base in (DECODE, DECODE2):
            router.post(f"{base}/responses").mock(side_effect=fake.create(base))
            router.route(url__regex=rf"{base}/responses/[^/]+(/cancel)?$").mock(side_effect=fake.retrieve(base))
        yield fake


def _endpoint_of(response_id: str) -> str:
    own, _, tag = response_id.rpartition(".pd")
    assert own.startswith("resp_") and tag, response_id
    (base,) = [b for b in (DECODE, DECODE2) if endpoint_tag(b) == tag]
    return base


async def test_a_follow_up_lands_on_the_endpoint_that_stored_its_previous_response(
    mode: str, servers: StoringDecodes
) -> None:
    traces: list[PDTrace] = []
    t = Twin(mode, decode_base_url=[DECODE, DECODE2], on_trace=traces.append)
    firsts = set()
    for n in range(10):
        first = await t.call(t.client.responses.create, model="m", input=f"hi {n}")
        stored_at, own = _endpoint_of(first.id), first.id.rpartition(".pd")[0]
        assert servers.bodies[-1][0] == stored_at and own in servers.stored[stored_at]
        firsts.add(stored_at)
        follow_up = await t.call(t.client.responses.create, model="m", input="and?", previous_response_id=first.id)
        base, body = servers.bodies[-1]
        assert base == stored_at and body["previous_response_id"] == own  # the server's own id
        assert follow_up.previous_response_id == first.id  # the echo carries the tag too
        assert _endpoint_of(follow_up.id) == stored_at
        trace = traces[-1]
        assert trace.outcome is Outcome.DECODE_ONLY and trace.remote_prefill_reason == "stored_state"
        assert trace.decode_url == stored_at and trace.decode_route == "conversation/stored_state"
    assert firsts == {DECODE, DECODE2}  # both endpoints stored some: the pin, not luck, found them
    await t.close()


async def test_a_secret_keys_the_tag_and_every_replica_sharing_it_routes_it(mode: str, servers: StoringDecodes) -> None:
    """An unkeyed tag is a hash of the endpoint's URL: hashing the candidate URLs (every
    loopback port) names the decode server. Keyed with the operator's secret, a tag routes
    in every replica given that secret and tells nothing without it."""
    secret = "s" * 32
    one = Twin(mode, decode_base_url=[DECODE, DECODE2], reuse_secret=secret)
    other = Twin(mode, decode_base_url=[DECODE, DECODE2], reuse_secret=secret)
    for n in range(6):
        first = await one.call(one.client.responses.create, model="m", input=f"hi {n}")
        stored_at = servers.bodies[-1][0]
        tag = first.id.rpartition(".pd")[2]
        assert tag not in (endpoint_tag(DECODE), endpoint_tag(DECODE2)), "the unkeyed hash names the server"
        assert tag == endpoint_tag(stored_at, secret) != endpoint_tag(stored_at, "t" * 32)
        await other.call(other.client.responses.create, model="m", input="and?", previous_response_id=first.id)
        assert servers.bodies[-1][0] == stored_at
    await one.close()
    await other.close()


async def test_a_streams_response_events_carry_the_tagged_id(mode: str, servers: StoringDecodes) -> None:
    t = Twin(mode, decode_base_url=[DECODE, DECODE2])
    for n in range(4):
        raw = await t.call(t.client.responses.with_raw_response.create, model="m", input=f"hi {n}", stream=True)
        stream = raw.parse()
        events = list(stream) if mode == "sync" else [e async for e in stream]
        ids = {e.response.id for e in events if e.type in ("response.created", "response.completed")}
        (tagged,) = ids
        base = _endpoint_of(tagged)
        assert base == servers.bodies[-1][0]
        assert [e.delta for e in events if e.type == "response.output_text.delta"] == ["Hi"]
        follow_up = await t.call(t.client.responses.create, model="m", input="and?", previous_response_id=tagged)
        assert servers.bodies[-1][0] == base and _endpoint_of(follow_up.id) == base
    await t.close()


def test_a_streams_other_bytes_reach_the_caller_as_sent(servers: StoringDecodes) -> None:
    t = Twin("sync", decode_base_url=[DECODE])
    with t.client.responses.with_streaming_response.create(model="m", input="hi", stream=True) as raw:
        body = b"".join(raw.iter_bytes())
    tag = endpoint_tag(DECODE)
    sent = servers.raw_streams[-1]
    own = json.loads(sent.split(b"data: ")[1].split(b"\n")[0])["response"]["id"]
    assert body == sent.replace(f'"{own}"'.encode(), f'"{own}.pd{tag}"'.encode())
    assert body.count(f".pd{tag}".encode()) == 2


async def test_a_tag_of_an_endpoint_gone_from_the_pool_gets_the_servers_404(mode: str, servers: StoringDecodes) -> None:
    t = Twin(mode, decode_base_url=[DECODE, DECODE2], remote_prefill="always")
    gone = f"resp_{'0' * 32}.pd{endpoint_tag(GONE)}"
    with pytest.raises(openai.NotFoundError) as caught:
        await t.call(t.client.responses.create, model="m", input="and?", previous_response_id=gone)
    assert caught.value.status_code == 404 and f"resp_{'0' * 32}" in str(caught.value)
    (_, body), *_ = servers.bodies
    assert body["previous_response_id"] == f"resp_{'0' * 32}"
    with pytest.raises(openai.NotFoundError):
        await t.call(t.client.responses.retrieve, gone)
    await t.close()


async def test_an_untagged_id_goes_as_it_came(mode: str, servers: StoringDecodes) -> None:
    t = Twin(mode, decode_base_url=[DECODE])
    servers.stored[DECODE].add("resp_own")
    answer = await t.call(t.client.responses.create, model="m", input="and?", previous_response_id="resp_own")
    base, body = servers.bodies[-1]
    assert base == DECODE and body["previous_response_id"] == "resp_own"
    assert answer.previous_response_id == f"resp_own.pd{endpoint_tag(DECODE)}"
    await t.close()


async def test_retrieve_and_cancel_of_a_tagged_id_go_to_the_endpoint_that_stored_it(
    mode: str, servers: StoringDecodes
) -> None:
    t = Twin(mode, decode_base_url=[DECODE, DECODE2])
    for n in range(6):
        first = await t.call(t.client.responses.create, model="m", input=f"hi {n}")
        stored_at, own = _endpoint_of(first.id), first.id.rpartition(".pd")[0]
        got = await t.call(t.client.responses.retrieve, first.id)
        assert servers.paths[-1] == (stored_at, f"/v1/responses/{own}") and got.id == first.id
        cancelled = await t.call(t.client.responses.cancel, first.id)
        assert servers.paths[-1] == (stored_at, f"/v1/responses/{own}/cancel")
        assert cancelled.id == first.id and cancelled.status == "cancelled"
    await t.close()
