"""Non-streamed calls that may move, on real vLLM: the body pdclient assembles is vLLM's own.

With ``migrate_non_streamed`` on, a non-streamed call that may move to another decode endpoint streams its decode leg
(``return_token_ids``, ``stream_options.include_usage``) and pdclient assembles the JSON body
the caller asked for (``pdclient.migration.Assembler``). Here the same greedy request goes
through the session pair twice: once unable to move (``max_decode_migrations=0``: vLLM's own
non-streamed body, passed through) and once assembled. Every field the openai SDK reads
must be equal (message, finish_reason, stop_reason, logprobs, usage, the ids the caller
asked for), and the body must have exactly vLLM's fields.

A call may move only when the pool has a second decode endpoint: the session decode is
listed twice (``127.0.0.1`` and ``localhost``), and a routing policy keeps every decode on
the first, so both calls run on one server. The last test kills a decode server of its own
mid-answer (as tests/pair/test_migration.py does) under a non-streamed call, which
completes on the survivor.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import pytest

from pdclient import AsyncPDChatClient, PDChatClient, PDOptions, PDTrace, PDTransport, RouteRequest
from pdclient.local import PDServers

from .extra_decode import ExtraDecode
from .helpers import LONG_STORY, WITH_LOGPROBS, same_greedy_answer, tops, user

GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 48}
CUT_AFTER = 16
ATTEMPTS = 3


class Prefer:
    """A routing policy that sends every decode to one endpoint while it is admitted."""

    def __init__(self, url: str) -> None:
        self.url = url

    def choose(self, endpoints: Sequence[Any], request: RouteRequest) -> Any:
        return next((e for e in endpoints if e.url == self.url), endpoints[0])


def alias(url: str) -> str:
    """The same server under another name: a second decode endpoint for the pool, one server."""
    assert "://127.0.0.1:" in url, url
    return url.replace("://127.0.0.1:", "://localhost:")


def clients(pd: PDServers, mode: str) -> tuple[Any, Any]:
    """(as today, assembled): the same pool, the same routing; only whether the call may move differs."""
    urls: Any = {"prefill_base_url": pd.prefill_url, "decode_base_url": [pd.decode_url, alias(pd.decode_url)]}
    common = {**urls, "routing": Prefer(pd.decode_url), "api_key": "-", "max_retries": 0, "migrate_non_streamed": True}
    kind = PDChatClient if mode == "sync" else AsyncPDChatClient
    return kind(**common, max_decode_migrations=0), kind(**common)


def compare(ours: dict[str, Any], vllms: dict[str, Any]) -> None:
    """Field for field; ``id`` and ``created`` are per request, so only their kind is compared."""
    assert list(ours) == list(vllms), "the same top-level fields, in vLLM's order"
    assert ours["id"].split("-")[0] == vllms["id"].split("-")[0] and isinstance(ours["created"], int)
    for name in vllms:
        if name not in ("id", "created", "choices"):
            assert ours[name] == vllms[name], name
    (choice,), (expected,) = ours["choices"], vllms["choices"]
    assert list(choice) == list(expected)
    if "message" in expected:
        assert list(choice["message"]) == list(expected["message"])
    assert choice == expected


@pytest.mark.parametrize(
    "request_fields",
    [
        {"messages": user("Name three colours, one per line."), **GREEDY, "max_tokens": 8, **WITH_LOGPROBS},
        {"messages": user("Say hi."), "temperature": 0, "max_tokens": 64, "extra_body": {"return_token_ids": True}},
        {"prompt": "The capital of France is", **GREEDY, "extra_body": {"return_token_ids": True}},
    ],
    ids=["chat, logprobs, length", "chat, own ids, stop", "completions, own ids"],
)
async def test_the_assembled_body_is_vllms_own(mode: str, pd: PDServers, request_fields: dict[str, Any]) -> None:
    today, assembled = clients(pd, mode)
    api = "completions" if "prompt" in request_fields else "chat"

    async def raw_body(client: Any) -> dict[str, Any]:
        resource = client.completions if api == "completions" else client.chat.completions
        response = resource.with_raw_response.create(model=pd.model, **request_fields)
        if mode == "async":
            response = await response
        assert response.http_response.headers["content-type"].startswith("application/json")
        body: dict[str, Any] = response.http_response.json()
        return body

    # Twice as today first: the prompt is then cached on both servers for every call compared.
    await raw_body(today)
    vllms = await raw_body(today)
    ours = await raw_body(assembled)
    for client in (today, assembled):
        closed = client.close()
        if mode == "async":
            await closed
    compare(ours, vllms)
    (choice,) = ours["choices"]
    answer = choice["message"]["content"] if api == "chat" else choice["text"]
    print(f"\n{api}: {choice['finish_reason']} after {ours['usage']['completion_tokens']} tokens: {answer!r}")


def test_the_assembled_body_went_through_a_stream(pd: PDServers) -> None:
    """The comparison above compares two paths: the assembled call's decode leg did stream."""
    bodies: list[bytes] = []

    class Recording(httpx.HTTPTransport):
        def handle_request(self, request: httpx.Request) -> httpx.Response:
            bodies.append(request.content)
            return super().handle_request(request)

    options = PDOptions(
        prefill_base_url=pd.prefill_url,
        decode_base_url=[pd.decode_url, alias(pd.decode_url)],
        routing=Prefer(pd.decode_url),
        migrate_non_streamed=True,
    )
    transport = PDTransport(options=options, leg_transport=Recording())
    with PDChatClient(http_client=httpx.Client(transport=transport), api_key="-", max_retries=0) as client:
        client.chat.completions.create(model=pd.model, messages=user("Say hi."), **GREEDY)
    decode = bodies[-1]
    assert b'"stream":true' in decode and b'"include_usage":true' in decode and b'"return_token_ids":true' in decode


# -- a decode killed mid-answer -----------------------------------------------------------------


class KillAfter(httpx.HTTPTransport):
    """Sends the legs; once a streamed decode on ``url`` has sent ``CUT_AFTER`` token chunks, kills its server."""

    def __init__(self, server: ExtraDecode) -> None:
        super().__init__()
        self.server = server
        self.killed = False

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = super().handle_request(request)
        if str(request.url).startswith(self.server.url) and b'"stream":true' in request.content:
            response.stream = self._counting(response.stream)  # type: ignore[arg-type]
        return response

    def _counting(self, stream: Any) -> Any:
        owner = self

        class Counting(httpx.SyncByteStream):
            def __iter__(self) -> Iterator[bytes]:
                seen = 0
                for chunk in stream:
                    seen += chunk.count(b'"token_ids":[')
                    if seen >= CUT_AFTER and not owner.killed:
                        owner.killed = True
                        owner.server.kill()
                    yield chunk

            def close(self) -> None:
                stream.close()

        return Counting()


@pytest.fixture(scope="module")
def d2(pd: PDServers) -> Iterator[ExtraDecode]:
    server = ExtraDecode.beside(pd.prefill_url, pd.local).start()
    yield server
    server.stop()


def test_a_non_streamed_call_whose_decode_is_killed_completes(
    pd: PDServers, d2: ExtraDecode, killed_answer_tokens: int
) -> None:
    request: Any = {
        "model": pd.model,
        "messages": user(LONG_STORY),
        "temperature": 0,
        "max_tokens": killed_answer_tokens,
        "extra_body": {"ignore_eos": True},
        **WITH_LOGPROBS,
    }
    for _ in range(ATTEMPTS):
        d2.ensure_running()
        traces: list[PDTrace] = []
        killing = KillAfter(d2)
        options = PDOptions(
            prefill_base_url=pd.prefill_url,
            decode_base_url=[d2.url, pd.decode_url],
            routing=Prefer(d2.url),
            on_trace=traces.append,
            migrate_non_streamed=True,
        )
        transport = PDTransport(options=options, leg_transport=killing)
        with PDChatClient(http_client=httpx.Client(transport=transport), api_key="-", max_retries=0) as client:
            answer = client.chat.completions.create(**request)
        (trace,) = traces
        assert trace.outcome.value == "disaggregated" and trace.error is None
        if trace.migrations:
            break
        print("\nD2 had sent its whole answer before the kill landed: again")
    else:
        pytest.fail(f"in {ATTEMPTS} attempts D2 always finished before the kill landed")
    (moved,) = trace.migrations
    assert (moved.from_url, moved.to_url) == (d2.url, pd.decode_url) and moved.after_tokens >= CUT_AFTER
    assert answer.usage is not None and answer.usage.completion_tokens == killed_answer_tokens
    with pd.client(max_retries=0) as survivor:
        expected = survivor.chat.completions.create(**request)
    found = same_greedy_answer(tops(answer.choices[0].logprobs), tops(expected.choices[0].logprobs))
    if found == "equal":
        assert answer.choices[0].message.content == expected.choices[0].message.content
    assert answer.usage.prompt_tokens == expected.usage.prompt_tokens  # type: ignore[union-attr]
    print(f"\nmoved after {moved.after_tokens} tokens, pause {moved.pause_ms:.0f} ms; against D1's answer: {found}")
