"""`pdclient serve`'s app against the loopback stub: routes, streaming, limits, keys, failures."""

from __future__ import annotations

import threading

import httpx
import openai
import orjson
import pytest

from tests.polling import until
from tests.stubserver import Fault, StubServer, closed_port_url

from .conftest import ANSWER, MESSAGES, PROMPT_TOKENS, RunningProxy, config_for, running_proxy

CHAT = {"model": "m", "messages": MESSAGES}


async def scrape(proxy: RunningProxy) -> str:
    async with httpx.AsyncClient() as http:
        return (await http.get(proxy.url + "/metrics")).text


def metrics_text(proxy: RunningProxy) -> str:
    """The proxy's metrics as a scrape shows them, read in-process (for polling)."""
    from prometheus_client import generate_latest

    return generate_latest(proxy.proxy.scrape_registry).decode()


async def test_openai_sdk_streams_a_chat_through_the_handoff(proxy: RunningProxy, stub: StubServer) -> None:
    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="-") as client:
        stream = await client.chat.completions.create(model="m", messages=MESSAGES, stream=True)
        text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert text == ANSWER
    prefill, decode = stub.legs("prefill"), stub.legs("decode")
    assert len(prefill) == len(decode) == 1
    assert decode[0].forwarded_ids == PROMPT_TOKENS and decode[0].ids_match is True
    assert prefill[0].headers["x-request-id"] == decode[0].headers["x-request-id"]


async def test_json_chat_and_completions(proxy: RunningProxy, stub: StubServer) -> None:
    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="-") as client:
        chat = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
        assert chat.parse().choices[0].message.content == ANSWER
        assert chat.headers["x-request-id"] != stub.legs("decode")[0].headers["x-request-id"]
        assert not [h for h in chat.headers if h.startswith("x-pd-")], "trace headers name the servers: off by default"
        completion = await client.completions.create(model="m", prompt="Once upon a time", max_tokens=5)
    assert completion.choices[0].text == ANSWER
    assert isinstance(stub.legs("decode")[1].body["prompt"], list)


async def test_each_chunk_reaches_the_caller_before_the_stub_sends_the_next(stub: StubServer) -> None:
    gate = threading.Semaphore(0)
    stub.inject(Fault(event_gate=gate), leg="decode")
    events = []
    with running_proxy(config_for(stub.url)) as proxy:
        async with httpx.AsyncClient(timeout=5) as http:
            body = {**CHAT, "stream": True}
            async with http.stream("POST", proxy.base_url + "/chat/completions", json=body) as response:
                assert response.status_code == 200
                assert response.headers["content-type"].startswith("text/event-stream")
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
                        gate.release()  # only now may the stub send the next event
    # Had the proxy held any chunk back, the stub would still be waiting at its gate.
    assert events[-1] == "data: [DONE]" and len(events) == 7
    assert [s.how for s in stub.streams] == ["completed"]


async def test_a_method_it_does_not_proxy_is_a_405_naming_it(proxy: RunningProxy, stub: StubServer) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.request("TRACE", proxy.base_url + "/models")
    assert response.status_code == 405 and "TRACE" in response.json()["error"]["message"]
    assert "POST" in response.headers["allow"] and not stub.received


async def test_header_bytes_beyond_ascii_reach_both_legs_unchanged(proxy: RunningProxy, stub: StubServer) -> None:
    """A header value in UTF-8 (some clients send them) passes as the caller's bytes."""
    async with httpx.AsyncClient() as http:
        headers = {"x-user": "Zoë".encode(), "x-request-id": b"r-\xc3\xa9"}
        response = await http.post(proxy.base_url + "/chat/completions", json=CHAT, headers=headers)
    assert response.status_code == 200
    for leg in (*stub.legs("prefill"), *stub.legs("decode")):
        # http.server decodes header bytes as latin-1: the UTF-8 bytes show as two characters each.
        assert leg.headers["x-user"] == "Zoë".encode().decode("latin-1")
        assert leg.headers["x-request-id"].startswith("pd-")  # the legs' own id, never the caller's
    assert dict(response.headers.raw)[b"x-request-id"] == b"r-\xc3\xa9"  # echoed as the bytes it came as


async def test_request_id_is_kept_and_query_passes_through(proxy: RunningProxy, stub: StubServer) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.get(proxy.base_url + "/models?limit=5", headers={"x-request-id": "caller-7"})
    assert response.status_code == 200 and response.json()["data"][0]["id"] == "stub-model"
    assert response.headers["x-request-id"] == "caller-7"
    (models,) = stub.received
    assert models.path == "/v1/models" and models.query == "limit=5"
    assert models.headers["x-request-id"] != "caller-7"


async def test_the_legs_id_is_neither_the_callers_nor_the_one_it_is_answered(
    proxy: RunningProxy, stub: StubServer
) -> None:
    """vLLM's push mode pairs a decode with a prefill by the id both legs carry: a caller
    must neither choose it (its ``x-request-id`` is a correlation id, echoed) nor learn the
    next one from its answers."""
    async with httpx.AsyncClient() as http:
        chosen = await http.post(proxy.base_url + "/chat/completions", json=CHAT, headers={"x-request-id": "victim"})
        answered = [
            (await http.post(proxy.base_url + "/chat/completions", json=CHAT)).headers["x-request-id"] for _ in range(2)
        ]
    assert chosen.status_code == 200 and chosen.headers["x-request-id"] == "victim"
    prefill, decode = stub.legs("prefill"), stub.legs("decode")
    legs = [leg.headers["x-request-id"] for leg in prefill]
    assert legs == [leg.headers["x-request-id"] for leg in decode] and len(set(legs)) == 3
    assert "victim" not in legs and not set(answered) & set(legs)
    assert len({leg_id[:19] for leg_id in legs + answered}) == 5, "no shared per-worker prefix"


async def test_other_routes_pass_through_to_decode_unchanged(proxy: RunningProxy, stub: StubServer) -> None:
    async with httpx.AsyncClient() as http:
        response = await http.post(proxy.base_url + "/embeddings", json={"model": "m", "input": "hi"})
        assert response.status_code == 404  # the stub has no such route: its answer, as it gave it
        assert response.json()["error"]["message"] == "no route POST /v1/embeddings"
        (seen,) = stub.received
        assert seen.leg == "other" and seen.body == {"model": "m", "input": "hi"}
        # Read as the servers' router reads it (decoded once), and sent in that one spelling.
        encoded = await http.get(proxy.base_url + "/models/org%2Fname")
        assert encoded.status_code == 404 and stub.received[-1].path == "/v1/models/org/name"
        missing = await http.get(proxy.url + "/nothing-here")
        assert missing.status_code == 404 and len(stub.received) == 2  # outside /v1: not proxied


async def test_a_multipart_upload_reaches_the_decode_whole(proxy: RunningProxy, stub: StubServer) -> None:
    """A file upload (the openai SDK's files API) passes through, body and framing intact."""
    content = "é\n".encode() * 5000
    async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="-", max_retries=0) as client:
        created = await client.files.create(file=("a.jsonl", content), purpose="batch")
    (upload,) = stub.received
    assert upload.path == "/v1/files" and created.bytes == len(upload.raw_body)
    assert b'filename="a.jsonl"' in upload.raw_body and content in upload.raw_body


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
async def test_body_over_the_limit_is_413_naming_the_limit(stub: StubServer, chunked: bool) -> None:
    big = orjson.dumps({**CHAT, "padding": "x" * 5000})

    async def body_in_pieces():  # no content-length: the proxy must count as it reads
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000]

    with running_proxy(config_for(stub.url, max_body_size=4096)) as proxy:
        async with httpx.AsyncClient() as http:
            url = proxy.base_url + "/chat/completions"
            response = await http.post(url, content=body_in_pieces() if chunked else big)
            assert response.status_code == 413
            assert "limit of 4096 bytes" in response.json()["error"]["message"]
            assert stub.received == []
            small = await http.post(url, json=CHAT)
            assert small.status_code == 200


async def test_api_keys(stub: StubServer) -> None:
    with running_proxy(config_for(stub.url, api_keys=("k1", "k2"))) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            url = "/v1/chat/completions"
            assert (await http.post(url, json=CHAT)).status_code == 401
            wrong = await http.post(url, json=CHAT, headers={"authorization": "Bearer k3"})
            assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"
            assert "invalid API key" in wrong.json()["error"]["message"]
            assert stub.received == []
            for key in ("k1", "k2"):
                ok = await http.post(url, json=CHAT, headers={"authorization": f"Bearer {key}"})
                assert ok.status_code == 200
            # The caller's key is the proxy's business: the servers never see it.
            assert all("authorization" not in r.headers for r in stub.received)
            assert (await http.get("/health")).status_code == 200  # probes need no key
            assert (await http.get("/metrics")).status_code == 200


@pytest.mark.parametrize(
    ("settings", "expected"),
    [({"forward_api_key": True}, "Bearer caller-key"), ({"upstream_api_key": "server-key"}, "Bearer server-key")],
    ids=["forward", "upstream"],
)
async def test_keys_reach_the_servers_only_when_asked(stub: StubServer, settings: dict, expected: str) -> None:
    with running_proxy(config_for(stub.url, api_keys=("caller-key",), **settings)) as proxy:
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="caller-key") as client:
            await client.chat.completions.create(model="m", messages=MESSAGES)
    assert [r.headers["authorization"] for r in stub.received] == [expected, expected]


async def test_caller_disconnect_mid_stream_closes_the_decode(stub: StubServer) -> None:
    gate = threading.Semaphore(0)  # never released: the stub holds the second event back
    stub.inject(Fault(event_gate=gate), leg="decode")
    with running_proxy(config_for(stub.url)) as proxy:
        async with httpx.AsyncClient(timeout=5) as http:
            body = {**CHAT, "stream": True}
            async with http.stream("POST", proxy.base_url + "/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        break  # one event, then the caller goes away (closes its connection)
        await until(lambda: stub.streams, what="the stub to see its stream end")
        (end,) = stub.streams
        assert end.how == "client closed" and end.events_sent == 1
        # The call is over for the proxy too: nothing in flight, the endpoint released.
        await until(lambda: all(e.in_flight == 0 for e in proxy.proxy.transport.fleet.decode.endpoints))
        metrics = await scrape(proxy)
        assert 'pdclient_calls_in_flight{route="chat"} 0.0' in metrics
        assert 'pdclient_calls_total{outcome="disaggregated",route="chat"} 1.0' in metrics


async def test_caller_leaving_before_the_decode_answers_cancels_the_call(stub: StubServer) -> None:
    """The decode is slow to answer, the caller goes: the proxy cancels the call and closes the
    decode's connection (a vLLM decode aborted so frees the prefill's KV itself: tests/pair)."""
    stub.inject(Fault(delay=1.5), leg="decode")
    with running_proxy(config_for(stub.url)) as proxy:
        async with httpx.AsyncClient(timeout=httpx.Timeout(5, read=0.4)) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(proxy.base_url + "/chat/completions", json={**CHAT, "stream": True})
        failed = 'pdclient_calls_total{outcome="failed",route="chat"} 1.0'
        await until(lambda: failed in metrics_text(proxy), what="the call to end")
        assert all(e.in_flight == 0 for e in proxy.proxy.transport.fleet.decode.endpoints)
        assert len(stub.legs("decode")) == 1  # no release: the decode request had reached its server


async def test_prefill_down_goes_decode_only_by_default(stub: StubServer) -> None:
    with running_proxy(config_for(closed_port_url(), stub.url)) as proxy:
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="-") as client:
            chat = await client.chat.completions.create(model="m", messages=MESSAGES)
        assert chat.choices[0].message.content == ANSWER
        (decode,) = stub.legs("decode")
        assert decode.forwarded_ids is None and "kv_transfer_params" not in decode.body
        metrics = await scrape(proxy)
        assert 'pdclient_calls_total{outcome="prefill_failed",route="chat"} 1.0' in metrics


async def test_prefill_down_with_fail_policy_is_an_error(stub: StubServer) -> None:
    with running_proxy(config_for(closed_port_url(), stub.url, on_prefill_failure="fail")) as proxy:
        async with httpx.AsyncClient() as http:
            response = await http.post(proxy.base_url + "/chat/completions", json=CHAT)
        assert response.status_code == 502 and response.headers["x-pd-failed-leg"] == "prefill"
        assert "prefill leg failed" in response.json()["error"]["message"]
        assert stub.received == []


async def test_decode_unreachable_is_502(stub: StubServer) -> None:
    with running_proxy(config_for(stub.url, closed_port_url())) as proxy:
        async with httpx.AsyncClient() as http:
            response = await http.post(proxy.base_url + "/chat/completions", json=CHAT)
    assert response.status_code == 502 and response.headers["x-pd-failed-leg"] == "decode"
    assert response.json()["error"]["message"] == "pdclient serve: decode leg failed: connect error"


async def test_a_caller_cannot_name_a_fallback_server(proxy: RunningProxy, stub: StubServer) -> None:
    """The library follows a per-call fallback URL; through a proxy that would let any caller
    make it send requests anywhere. The proxy turns PDOptions.allow_call_fallback_url off."""
    async with httpx.AsyncClient() as http:
        url = proxy.base_url + "/chat/completions"
        for spelling in (b'"pdclient"', b'"\\u0070dclient"'):
            body = b'{"model":"m","messages":[],' + spelling + b':{"on_prefill_failure":"http://127.0.0.1:9/v1"}}'
            response = await http.post(url, content=body, headers={"content-type": "application/json"})
            assert response.status_code == 400
            assert "not a fallback URL" in response.json()["error"]["message"]
        assert stub.received == []
        fine = await http.post(url, json={**CHAT, "pdclient": {"on_prefill_failure": "fail", "session": "u1"}})
        assert fine.status_code == 200
    assert 'pdclient_calls_total{outcome="refused",route="chat"} 2.0' in await scrape(proxy)


async def test_health_and_ready(stub: StubServer) -> None:
    with running_proxy(config_for(stub.url)) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            assert (await http.get("/health")).json() == {"status": "ok"}
            ready = await http.get("/ready")
            assert ready.status_code == 200 and ready.json()["degraded"] is False
            assert ready.json()["prefill"] == [{"url": stub.url, "state": "closed", "admitted": True, "in_flight": 0}]
    prefill = closed_port_url()
    with running_proxy(config_for(prefill, closed_port_url(), breaker_failures=1)) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            assert (await http.get("/ready")).status_code == 200  # nothing has failed yet
            await http.post("/v1/chat/completions", json=CHAT)  # both refused: both breakers open
            ready = await http.get("/ready")
            assert ready.status_code == 503 and ready.json()["decode"][0]["state"] == "open"
            assert (await http.get("/health")).status_code == 200


@pytest.mark.parametrize(
    ("settings", "ready"),
    [({}, True), ({"on_prefill_failure": "fail"}, False), ({"ready_requires_prefill": True}, False)],
    ids=["decode-only", "fail", "requires-prefill"],
)
async def test_ready_with_the_prefill_down_follows_the_failure_policy(
    stub: StubServer, settings: dict, ready: bool
) -> None:
    """Decode-only (the default) still answers every call, so the proxy stays ready, degraded:
    taking every replica out of the load balancer would turn slower answers into none."""
    prefill = closed_port_url()
    with running_proxy(config_for(prefill, stub.url, breaker_failures=2, **settings)) as proxy:
        async with httpx.AsyncClient(base_url=proxy.url) as http:
            await http.post("/v1/chat/completions", json=CHAT)  # prefill refused: its breaker opens
            response = await http.get("/ready")
    body = response.json()
    assert body["prefill"] == [{"url": prefill, "state": "open", "admitted": False, "in_flight": 0}]
    assert body["decode"][0]["state"] == "closed"
    assert (response.status_code, body["ready"], body["degraded"]) == (
        (200, True, True) if ready else (503, False, False)
    )


async def test_trace_headers_when_asked(stub: StubServer) -> None:
    with running_proxy(config_for(stub.url, trace_headers=True)) as proxy:
        async with openai.AsyncOpenAI(base_url=proxy.base_url, api_key="-") as client:
            raw = await client.chat.completions.with_raw_response.create(model="m", messages=MESSAGES)
    from pdclient import PDTrace

    trace = PDTrace.from_headers(raw.headers)
    assert trace.forwarded_tokens == PROMPT_TOKENS and trace.prefill_url == stub.url


async def test_a_decode_stream_cut_upstream_is_cut_for_the_caller(proxy: RunningProxy, stub: StubServer) -> None:
    stub.inject(Fault(drop_after_events=2), leg="decode")
    events = []
    async with httpx.AsyncClient(timeout=5) as http:
        body = {**CHAT, "stream": True}
        async with http.stream("POST", proxy.base_url + "/chat/completions", json=body) as response:
            with pytest.raises(httpx.RemoteProtocolError):  # not a clean end: the caller can tell
                async for line in response.aiter_lines():
                    if line.startswith("data: "):
                        events.append(line)
    assert len(events) == 2
    assert 'pdclient_calls_total{outcome="failed",route="chat"} 1.0' in await scrape(proxy)
