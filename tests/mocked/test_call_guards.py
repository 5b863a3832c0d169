"""What a call may carry and ask for, and what it costs the fleet when a tier is down.

- No request pdclient forwards, P/D or pass-through, on any path and in any encoding,
  carries a ``kv_transfer_params`` pdclient did not write: it is a 400 naming the field.
- With ``allow_call_overrides`` off, a call's own options may only make it more conservative.
- A tenant's conversations are its own.
- With no decode endpoint admitted, no prefill runs; a prefill whose decode cannot be
  reached is released.

Sync and async alike (the ``mode`` fixture).
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import openai
import pytest
import respx

from pdclient import AsyncPDTransport, Outcome, PDOptions, PDTrace, PDTransport, RetrySettings
from pdclient.routing import TENANT_EXTENSION
from tests.fake_vllm import DECODE, DECODE2, PREFILL, FakeVLLM, VLLMAnswers, chat_json, ids_of_conversation
from tests.twins import Twin, status_error

ROOT = DECODE.removesuffix("/v1")
MESSAGES = [{"role": "user", "content": "Is it up?"}]
FOREIGN = {"do_remote_prefill": True, "remote_host": "10.0.0.66", "remote_port": 5600, "remote_block_ids": [1]}
FAST = RetrySettings(backoff_initial=0.001, backoff_max=0.01)


class Client:
    """An httpx client on a P/D transport, sync or async, that records every call's trace."""

    def __init__(self, mode: str, **options: Any) -> None:
        self.traces: list[PDTrace] = []
        options = {"prefill_base_url": PREFILL, "decode_base_url": DECODE, "retries": FAST, **options}
        pd = PDOptions(on_trace=self.traces.append, **options)
        self.transport = PDTransport(options=pd) if mode == "sync" else AsyncPDTransport(options=pd)
        self.http: httpx.Client | httpx.AsyncClient = (
            httpx.Client(transport=self.transport)
            if isinstance(self.transport, PDTransport)
            else httpx.AsyncClient(transport=self.transport)
        )

    async def send(self, request: httpx.Request) -> httpx.Response:
        if isinstance(self.http, httpx.Client):
            return self.http.send(request)
        return await self.http.send(request)

    async def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return await self.send(self.http.build_request("POST", url, **kwargs))

    async def close(self) -> None:
        if isinstance(self.http, httpx.Client):
            self.http.close()
        else:
            await self.http.aclose()


@dataclass
class Upstream:
    router: respx.MockRouter
    bodies: list[bytes] = field(default_factory=list)
    """Each body a server received whole."""

    def answer(self, request: httpx.Request) -> httpx.Response:
        self.bodies.append(request.read())
        return httpx.Response(200, json={"ok": True, "text": "hi"})

    @property
    def calls(self) -> int:
        return sum(route.call_count for route in self.router.routes)


@pytest.fixture
def upstream(pd_routes: respx.MockRouter) -> Upstream:
    """Besides the P/D routes, every path of the decode server answers 200, as vLLM would."""
    servers = Upstream(pd_routes)
    pd_routes.route(host="decode.test", name="anything").mock(side_effect=servers.answer)
    return servers


def assert_refused(response: httpx.Response, *fragments: str) -> None:
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    for fragment in fragments:
        assert fragment in message, message


def body(**fields: Any) -> bytes:
    return json.dumps({"model": "m", **fields}).encode()


# -- kv_transfer_params: paths ------------------------------------------------------------------

PATHS = [
    f"{DECODE}/chat/completions",
    f"{DECODE}/completions",
    f"{DECODE}/chat%2Fcompletions",
    f"{DECODE}/responses",
    f"{DECODE}/messages",
    f"{DECODE}/messages/count_tokens",
    f"{ROOT}/invocations",
    f"{ROOT}/inference/v1/generate",
    f"{DECODE}/chat/completions/",
]


@pytest.mark.parametrize("url", PATHS)
async def test_kv_transfer_params_is_refused_on_every_path(mode: str, upstream: Upstream, url: str) -> None:
    client = Client(mode)
    fields = {"messages": MESSAGES, "prompt": "hi", "input": "hi", "kv_transfer_params": FOREIGN}
    response = await client.post(url, content=body(**fields), headers={"content-type": "application/json"})
    assert_refused(response, "kv_transfer_params is written by pdclient")
    assert upstream.calls == 0
    assert client.traces == [] or client.traces[0].outcome is Outcome.REFUSED
    await client.close()


# -- kv_transfer_params: encodings of the body ----------------------------------------------------

ESCAPED = b'{"model":"m","input":"hi","kv\\u005ftransfer_params":{"remote_host":"10.0.0.66"}}'
DUPLICATE = b'{"model":"m","input":"hi","kv_transfer_params":{"remote_host":"10.0.0.66"},"kv_transfer_params":null}'
NESTED = body(input="hi", messages=MESSAGES, vllm_xargs={"kv_transfer_params": [1]})
NESTED_STRING = body(input="hi", vllm_xargs=json.dumps({"kv\u005ftransfer_params": "x"}).replace("_", "\\u005f"))
NAN = b'{"model":"m","input":"hi","temperature":NaN,"kv_transfer_params":{}}'
UTF16 = json.dumps({"model": "m", "input": "hi", "kv_transfer_params": FOREIGN}).encode("utf-16")

BODIES = {
    "no-content-type": (body(input="hi", messages=MESSAGES, kv_transfer_params=FOREIGN), {}),
    "text-plain": (body(input="hi", kv_transfer_params=FOREIGN), {"content-type": "text/plain"}),
    "form-urlencoded-json": (
        body(input="hi", kv_transfer_params=FOREIGN),
        {"content-type": "application/x-www-form-urlencoded"},
    ),
    "escaped-key": (ESCAPED, {"content-type": "application/json"}),
    "duplicate-key": (DUPLICATE, {"content-type": "application/json"}),
    "in-vllm_xargs": (NESTED, {"content-type": "application/json"}),
    "in-a-vllm_xargs-string": (NESTED_STRING, {"content-type": "application/json"}),
    "nan-elsewhere": (NAN, {}),
    "utf-16": (UTF16, {"content-type": "application/json"}),
}


@pytest.mark.parametrize("path", ["/embeddings", "/responses", "/messages", "/chat/completions"])
@pytest.mark.parametrize("case", list(BODIES))
async def test_kv_transfer_params_is_refused_in_every_encoding_of_the_body(
    mode: str, upstream: Upstream, case: str, path: str
) -> None:
    content, headers = BODIES[case]
    client = Client(mode)
    response = await client.post(f"{DECODE}{path}", content=content, headers=headers)
    if path != "/embeddings" and case in ("utf-16", "nan-elsewhere"):
        assert_refused(response, "not a JSON object")  # a P/D call's body is read by pdclient: refused too
    else:
        assert_refused(response, "kv_transfer_params is written by pdclient")
    if case in ("in-vllm_xargs", "in-a-vllm_xargs-string"):
        assert "vllm_xargs.kv_transfer_params" in response.json()["error"]["message"]
    assert upstream.calls == 0
    await client.close()


@pytest.mark.parametrize("coding", ["gzip", "deflate", "identity, gzip"])
@pytest.mark.parametrize("path", ["/embeddings", "/chat/completions"])
async def test_a_compressed_body_is_refused_naming_its_encoding(
    mode: str, upstream: Upstream, coding: str, path: str
) -> None:
    plain = body(input="hi", messages=MESSAGES, kv_transfer_params=FOREIGN)
    content = zlib.compress(plain) if coding == "deflate" else gzip.compress(plain)
    client = Client(mode)
    response = await client.post(
        f"{DECODE}{path}", content=content, headers={"content-type": "application/json", "content-encoding": coding}
    )
    assert_refused(response, f"content-encoding {coding!r}", "uncompressed")
    assert upstream.calls == 0
    await client.close()


# -- kv_transfer_params: forms ------------------------------------------------------------------


@pytest.mark.parametrize("field", ["vllm_xargs", "kv_transfer_params"])
async def test_a_streamed_upload_naming_the_field_never_reaches_the_server_whole(
    mode: str, upstream: Upstream, field: str
) -> None:
    """vLLM's speech-to-text forms read ``vllm_xargs`` as JSON, whose ``kv_transfer_params``
    reaches the KV connector (escaped, it has none of the field's bytes)."""
    client = Client(mode)
    value = '{"kv\\u005ftransfer_params": []}' if field == "vllm_xargs" else "{}"
    request = client.http.build_request(
        "POST", f"{DECODE}/audio/transcriptions", data={"model": "w", field: value}, files={"file": ("a.wav", b"RIFF")}
    )
    with pytest.raises(httpx.RequestNotRead):
        request.content  # noqa: B018 (streamed, not read into memory)
    response = await client.send(request)
    assert_refused(response, field)
    assert upstream.bodies == []
    assert [e.in_flight for e in client.transport.fleet.decode.endpoints] == [0]
    await client.close()


async def test_a_multipart_body_that_is_json_is_refused(mode: str, upstream: Upstream) -> None:
    """``/invocations`` parses its body as JSON whatever the content-type says."""
    client = Client(mode)
    response = await client.post(
        f"{ROOT}/invocations", content=ESCAPED, headers={"content-type": "multipart/form-data; boundary=x"}
    )
    assert_refused(response, "must start with its boundary")
    assert upstream.calls == 0
    await client.close()


async def test_an_url_encoded_form_naming_the_field_is_refused(mode: str, upstream: Upstream) -> None:
    client = Client(mode)
    form = b"model=w&vllm%5Fxargs=%7B%7D"  # percent-encoded, as a form parser decodes it
    headers = {"content-type": "application/x-www-form-urlencoded"}
    response = await client.post(f"{DECODE}/audio/transcriptions", content=form, headers=headers)
    assert_refused(response, "vllm_xargs in a form")
    assert upstream.calls == 0
    await client.close()


async def test_ordinary_bodies_that_mention_the_field_pass(mode: str, upstream: Upstream) -> None:
    """The name in a message's text, an upload without it, a GET: forwarded as before."""
    client = Client(mode)
    question = [{"role": "user", "content": "What does kv_transfer_params do? \u00e9\\u"}]
    chat = await client.post(f"{DECODE}/chat/completions", json={"model": "m", "messages": question})
    assert chat.status_code == 200
    embedded = await client.post(f"{DECODE}/embeddings", json={"model": "e", "input": "kv_transfer_params"})
    assert embedded.status_code == 200
    upload = await client.post(
        f"{DECODE}/audio/transcriptions", data={"model": "w"}, files={"file": ("a.wav", b"RIFF" * 50_000)}
    )
    assert upload.status_code == 200 and upstream.bodies[-1].endswith(b"--\r\n")
    models = await client.send(client.http.build_request("GET", f"{DECODE}/models"))
    assert models.status_code == 200
    await client.close()


async def test_the_openai_sdk_gets_a_bad_request_naming_the_field(mode: str, pd_routes: respx.MockRouter) -> None:
    twin = Twin(mode)
    with pytest.raises(openai.BadRequestError, match="kv_transfer_params is written by pdclient") as excinfo:
        await twin.call(twin.client.responses.create, model="m", input="hi", extra_body={"kv_transfer_params": FOREIGN})
    assert status_error(excinfo).status_code == 400
    with pytest.raises(openai.BadRequestError, match=r"vllm_xargs\.kv_transfer_params"):
        await twin.chat(messages=MESSAGES, extra_body={"vllm_xargs": {"kv_transfer_params": [1]}})
    assert pd_routes["prefill"].call_count == 0 and pd_routes["decode"].call_count == 0
    await twin.close()


# -- JSON pdclient cannot read or write back ------------------------------------------------------


def nested(depth: int) -> Any:
    """A JSON value ``depth`` lists deep: vLLM reads it, orjson writes at most 254 levels."""
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


DEEP = nested(300)
USER = {"role": "user", "content": "hi"}
TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": DEEP}}]}
INFINITY = "number is infinity"
TOO_DEEP = "nested deeper than 254 levels"
CHAT_TOOL: Any = {"type": "function", "function": {"name": "f", "parameters": DEEP}}
UNREADABLE: list[tuple[str, bytes, str, str]] = [
    ("chat/completions", b'{"model":"m","messages":[],"pdclient":1e999}', "pdclient", INFINITY),
    ("completions", b'{"model":"m","prompt":"hi","pdclient":{"session":1e999}}', "pdclient", INFINITY),
    ("responses", b'{"model":"m","input":"hi","previous_response_id":1e999}', "previous_response_id", INFINITY),
    ("messages", b'{"model":"m","max_tokens":5,"messages":[],"pdclient":-1e999}', "pdclient", INFINITY),
    ("embeddings", b'{"model":"m","input":"hi","pdclient":1e999}', "pdclient", INFINITY),  # a pass-through
    ("chat/completions", body(messages=[{**USER, "content": [{"type": "text", "x": DEEP}]}]), "messages", TOO_DEEP),
    ("chat/completions", body(messages=[USER], tools=[CHAT_TOOL]), "tools", TOO_DEEP),
    ("responses", body(input=[USER, {"type": "function_call_output", "output": DEEP}]), "input", TOO_DEEP),
    ("responses", body(input="hi", tools=[{"type": "function", "name": "f", "parameters": DEEP}]), "tools", TOO_DEEP),
    ("messages", body(max_tokens=5, messages=[USER, TOOL_USE, USER]), "messages", TOO_DEEP),
    ("messages", body(max_tokens=5, messages=[USER], tools=[{"name": "f", "input_schema": DEEP}]), "tools", TOO_DEEP),
]
"""(route, body, the field named, why): bodies vLLM takes and pdclient refuses with a 400."""


@pytest.mark.parametrize(
    ("route", "content", "field", "why"), UNREADABLE, ids=[f"{c[0]}-{c[2]}-{c[3]}" for c in UNREADABLE]
)
async def test_json_pdclient_cannot_read_or_write_back_is_a_400_naming_the_field(
    mode: str, upstream: Upstream, route: str, content: bytes, field: str, why: str
) -> None:
    client = Client(mode)
    response = await client.post(f"{DECODE}/{route}", content=content, headers={"content-type": "application/json"})
    assert_refused(response, field, why)
    assert upstream.calls == 0
    assert all(trace.outcome is Outcome.REFUSED for trace in client.traces)  # a pass-through has none
    await client.close()


async def test_the_openai_sdk_gets_a_bad_request_for_json_nested_too_deep(mode: str, upstream: Upstream) -> None:
    twin = Twin(mode)
    with pytest.raises(openai.BadRequestError, match=f"tools: JSON {TOO_DEEP}"):
        await twin.chat(messages=MESSAGES, tools=[CHAT_TOOL])
    with pytest.raises(openai.BadRequestError, match=f"input: JSON {TOO_DEEP}"):
        await twin.call(twin.client.responses.create, model="m", input=[{**USER, "content": [DEEP]}])
    assert upstream.calls == 0
    await twin.close()


# -- per-call options that override the client's -------------------------------------------------

OVERRIDES = [
    ({"max_decode_migrations": 5}, {}, "pdclient.max_decode_migrations may be at most 1 here, not 5"),
    ({"on_prefill_failure": "decode"}, {"on_prefill_failure": "fail"}, 'pdclient.on_prefill_failure may be "fail"'),
    ({"remote_prefill": "never"}, {}, "pdclient.remote_prefill may be always or auto here, not never"),
    ({"remote_prefill": "auto"}, {"remote_prefill": "always"}, "pdclient.remote_prefill may be always here, not auto"),
    ({"remote_prefill": "never"}, {"remote_prefill": "auto"}, "not never"),
]


@pytest.mark.parametrize(("call", "client", "message"), OVERRIDES)
async def test_an_option_less_conservative_than_the_clients_is_refused_when_overrides_are_off(
    mode: str, pd_routes: respx.MockRouter, call: dict[str, Any], client: dict[str, Any], message: str
) -> None:
    traces: list[PDTrace] = []
    twin = Twin(mode, allow_call_overrides=False, on_trace=traces.append, **client)
    with pytest.raises(openai.BadRequestError, match=message) as excinfo:
        await twin.chat(messages=MESSAGES, extra_body={"pdclient": call})
    assert "allow_call_overrides is off" in str(excinfo.value)
    assert traces[0].outcome is Outcome.REFUSED
    assert pd_routes["prefill"].call_count == 0 and pd_routes["decode"].call_count == 0
    await twin.close()


NARROWING = [
    ({"max_decode_migrations": 0}, {}),
    ({"max_decode_migrations": 1}, {}),
    ({"on_prefill_failure": "fail"}, {}),
    ({"on_prefill_failure": "decode"}, {}),
    ({"remote_prefill": "always"}, {"remote_prefill": "never"}),
    ({"remote_prefill": "never"}, {"remote_prefill": "never"}),
    ({"forward_ids": False, "session": "mine"}, {}),
    ({"on_prefill_failure": "http://unified.test:8000/v1"}, {"on_prefill_failure": "fail"}),
]


@pytest.mark.parametrize(("call", "client"), NARROWING)
async def test_an_option_as_or_more_conservative_passes_when_overrides_are_off(
    mode: str, fake: FakeVLLM, call: dict[str, Any], client: dict[str, Any]
) -> None:
    twin = Twin(mode, allow_call_overrides=False, **client)
    completion = await twin.chat(messages=MESSAGES, extra_body={"pdclient": call})
    assert completion.choices[0].message.content
    await twin.close()


async def test_overrides_stay_allowed_in_the_library_by_default(mode: str, fake: FakeVLLM) -> None:
    twin = Twin(mode, on_prefill_failure="fail", remote_prefill="always")
    extra = {"pdclient": {"max_decode_migrations": 5, "on_prefill_failure": "decode", "remote_prefill": "never"}}
    completion = await twin.chat(messages=MESSAGES, extra_body=extra)
    assert completion.choices[0].message.content and fake.prefill_bodies == []
    await twin.close()


# -- tenants ------------------------------------------------------------------------------------

SYSTEM = {"role": "system", "content": "You are a storyteller. " + "Once upon a time there was a tale. " * 60}
TURN1: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Tell me a story."}]


@pytest.fixture
def pair() -> Iterator[FakeVLLM]:
    vllm = FakeVLLM(VLLMAnswers(ids=ids_of_conversation))
    with vllm.routes(PREFILL, DECODE, DECODE2):
        yield vllm


def chat_request(client: Client, messages: list[dict[str, Any]], tenant: str | None, **fields: Any) -> httpx.Request:
    request = client.http.build_request(
        "POST", f"{DECODE}/chat/completions", json={"model": "m", "messages": messages, **fields}
    )
    if tenant is not None:
        request.extensions[TENANT_EXTENSION] = tenant
    return request


@pytest.mark.parametrize("session", [None, "conversation-1"])
async def test_a_tenant_never_matches_another_tenants_conversation(
    mode: str, pair: FakeVLLM, session: str | None
) -> None:
    client = Client(mode, decode_base_url=[DECODE, DECODE2], max_decode_migrations=0)
    extra = {"pdclient": {"session": session}} if session else {}
    first = await client.send(chat_request(client, TURN1, "tenant-a", **extra))
    answer = first.json()["choices"][0]["message"]["content"]
    turn2 = [*TURN1, {"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    # Another tenant sending the very same conversation: nothing of tenant-a's is matched;
    # its call is read from its own messages, as it would be had tenant-a never called.
    other = await client.send(chat_request(client, turn2, "tenant-b", **extra))
    assert other.status_code == 200
    assert client.traces[1].conversation == "extends_history"
    fresh = Client(mode, decode_base_url=[DECODE, DECODE2], max_decode_migrations=0)
    assert (await fresh.send(chat_request(fresh, turn2, "tenant-b", **extra))).status_code == 200
    alone, seen = fresh.traces[0], client.traces[1]
    assert (alone.conversation, alone.outcome, alone.decode_url) == (seen.conversation, seen.outcome, seen.decode_url)
    await fresh.close()
    # The tenant that had the conversation still has it.
    own = await client.send(chat_request(client, turn2, "tenant-a", **extra))
    assert own.status_code == 200
    assert (client.traces[2].conversation, client.traces[2].outcome) == ("extends_answer", Outcome.DECODE_ONLY)
    await client.close()


def ids_of_what_a_template_renders(body: dict[str, Any]) -> list[int]:
    """One id per character of the messages' roles and contents: a field no template renders counts none."""
    messages = [{"role": m.get("role"), "content": m.get("content")} for m in body.get("messages") or []]
    return [ord(c) % 1000 for c in json.dumps(messages, sort_keys=True)]


async def test_a_tenants_calls_never_move_anothers_estimates(mode: str) -> None:
    """Ten calls of one tenant padded with a field no template renders (the servers count
    a few ids, the client a quarter of a megabyte) leave another tenant's ~6,000-token
    follow-up where it belongs: through the prefill. The follow-up's first turn went
    through another replica, so it is estimated with the chars-per-token ratio learned here."""
    vllm = FakeVLLM(VLLMAnswers(ids=ids_of_what_a_template_renders))
    with vllm.routes(PREFILL, DECODE, DECODE2):
        client = Client(mode, decode_base_url=[DECODE, DECODE2], max_decode_migrations=0)
        replica = Client(mode, decode_base_url=[DECODE, DECODE2], max_decode_migrations=0)
        first = await replica.send(chat_request(replica, TURN1, "tenant-b"))
        answer = first.json()["choices"][0]["message"]["content"]
        await replica.close()
        for i in range(10):
            padded = [{"role": "user", "content": f"Hello {i}", "metadata": "x" * 250_000}]
            assert (await client.send(chat_request(client, padded, "tenant-a"))).status_code == 200
        long = {"role": "user", "content": "A long question. " * 350}
        turn2 = [*TURN1, {"role": "assistant", "content": answer}, long]
        assert (await client.send(chat_request(client, turn2, "tenant-b"))).status_code == 200
        follow_up = client.traces[-1]
        assert follow_up.estimated_uncached_tokens is not None and follow_up.estimated_uncached_tokens > 2000
        assert (follow_up.outcome, follow_up.remote_prefill) == (Outcome.DISAGGREGATED, True)
        await client.close()


async def test_the_tenant_reaches_every_route_request(mode: str, pair: FakeVLLM) -> None:
    seen: list[tuple[str, str | None]] = []

    class Recording:
        name = "recording"

        def choose(self, endpoints: Any, request: Any) -> Any:
            seen.append((request.leg, request.tenant))
            return endpoints[0]

    client = Client(mode, routing=Recording(), max_decode_migrations=0)
    await client.send(chat_request(client, TURN1, "tenant-a"))
    await client.send(client.http.build_request("GET", f"{DECODE}/models", extensions={TENANT_EXTENSION: "tenant-a"}))
    assert seen == [("prefill", "tenant-a"), ("decode", "tenant-a"), ("decode", "tenant-a")]
    await client.close()


# -- a decode tier that is down -----------------------------------------------------------------


async def test_no_prefill_runs_when_no_decode_endpoint_is_admitted(mode: str, pd_routes: respx.MockRouter) -> None:
    traces: list[PDTrace] = []
    twin = Twin(mode, on_trace=traces.append)
    for endpoint in twin.client.pd_fleet.decode.endpoints:
        endpoint.trip()
    for _ in range(3):
        with pytest.raises(openai.InternalServerError) as excinfo:
            await twin.chat(messages=MESSAGES)
        assert status_error(excinfo).status_code == 503
        assert "every decode endpoint has its circuit breaker open" in str(excinfo.value)
    assert pd_routes["prefill"].call_count == 0 and pd_routes["decode"].call_count == 0
    assert traces[0].outcome is Outcome.FAILED and traces[0].failed_leg == "decode"
    await twin.close()


async def test_with_no_decode_endpoint_admitted_a_fallback_server_takes_the_call_whole(
    mode: str, pd_routes: respx.MockRouter
) -> None:
    fallback = "http://unified.test:8000/v1"
    unified = pd_routes.post(f"{fallback}/chat/completions").mock(return_value=httpx.Response(200, json=chat_json("u")))
    traces: list[PDTrace] = []
    twin = Twin(mode, on_trace=traces.append, on_prefill_failure=fallback)
    twin.client.pd_fleet.decode.endpoints[0].trip()
    completion = await twin.chat(messages=MESSAGES)
    assert completion.choices[0].message.content == "u"
    assert pd_routes["prefill"].call_count == 0 and unified.call_count == 1
    assert "kv_transfer_params" not in json.loads(unified.calls[0].request.content)
    assert "no decode endpoint admitted" in (traces[0].fallback or "")
    await twin.close()


async def test_a_prefill_whose_decode_endpoints_all_opened_meanwhile_is_released(
    mode: str, fake: FakeVLLM, pd_routes: respx.MockRouter
) -> None:
    """The breakers opened while the prefill ran (other calls failing): the release still goes out."""
    twin = Twin(mode)
    releases: list[dict[str, Any]] = []

    def prefill_then_outage(request: httpx.Request) -> httpx.Response:
        for endpoint in twin.client.pd_fleet.decode.endpoints:
            endpoint.trip()
        return fake.respond(request, at_prefill=True)

    def decode(request: httpx.Request) -> httpx.Response:
        releases.append(json.loads(request.content))
        return httpx.Response(200, json=chat_json("released"))

    pd_routes["prefill"].mock(side_effect=prefill_then_outage)
    pd_routes["decode"].mock(side_effect=decode)
    with pytest.raises(openai.InternalServerError):
        await twin.chat(messages=MESSAGES)
    assert len(releases) == 1 and releases[0]["max_tokens"] == 1
    assert releases[0]["kv_transfer_params"]["prompt_token_ids"] == fake.answers.ids(fake.prefill_bodies[0])
    assert [e.in_flight for e in twin.client.pd_fleet.decode.endpoints] == [0]
    await twin.close()
