"""Concurrent dispatch (``PDOptions.dispatch``) against the fake vLLM in push mode: every test sync and async."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from pdclient import PDConfigError, PDOptions, PDTrace
from pdclient.handoff import dispatch
from tests.fake_vllm import NIXL_PARAMS, FakeVLLM
from tests.twins import Twin, status_error

MESSAGES = [{"role": "user", "content": "What is P/D?"}]


def push_params(engine: str = "engine-p", mode: str | None = "push") -> Any:
    params = {**NIXL_PARAMS, "remote_engine_id": engine, "pp_size": 1}
    if mode is not None:
        params["transfer_mode"] = mode
    return lambda request_id, n: dict(params)


def traced(twin_kwargs: dict[str, Any]) -> list[PDTrace]:
    traces: list[PDTrace] = []
    twin_kwargs["on_trace"] = traces.append
    return traces


def is_concurrent_decode(body: dict[str, Any]) -> bool:
    kv = body.get("kv_transfer_params") or {}
    return kv.get("do_remote_prefill") is True and kv.get("remote_block_ids") == [] and "prompt_token_ids" not in kv


def test_options_are_checked() -> None:
    with pytest.raises(PDConfigError, match="dispatch must be one of sequential, concurrent, auto"):
        PDOptions(prefill_base_url="http://p/v1", decode_base_url="http://d/v1", dispatch="parallel")
    assert PDOptions(prefill_base_url="http://p/v1", decode_base_url="http://d/v1").dispatch == "sequential"


def test_which_coordinates_each_mode_uses() -> None:
    push = dispatch.Coordinates.from_kv_params(json.dumps({**NIXL_PARAMS, "transfer_mode": "push"}).encode())
    pull = dispatch.Coordinates.from_kv_params(json.dumps({**NIXL_PARAMS, "transfer_mode": "pull"}).encode())
    unsaid = dispatch.Coordinates.from_kv_params(json.dumps(NIXL_PARAMS).encode())
    assert push is not None and pull is not None and unsaid is not None
    assert [dispatch.usable("auto", c) for c in (push, pull, unsaid, None)] == [True, False, False, False]
    assert [dispatch.usable("concurrent", c) for c in (push, pull, unsaid, None)] == [True, False, True, False]
    assert not dispatch.usable("sequential", push)
    for odd in (b"", b"[]", b"{", json.dumps({**NIXL_PARAMS, "remote_port": "5600"}).encode()):
        assert dispatch.Coordinates.from_kv_params(odd) is None


async def test_first_call_learns_the_coordinates_then_both_legs_go_at_once(mode: str, fake: FakeVLLM) -> None:
    fake.answers.kv_params = push_params()
    kwargs: dict[str, Any] = {"dispatch": "auto"}
    traces = traced(kwargs)
    twin = Twin(mode, **kwargs)
    first = await twin.chat(messages=MESSAGES, max_tokens=8)
    second = await twin.chat(messages=MESSAGES, max_tokens=8)
    assert first.choices[0].message.content == second.choices[0].message.content == "echo:What is P/D?"
    assert [t.dispatch for t in traces] == ["sequential", "concurrent"]
    assert traces[1].fallback is None and traces[1].outcome.value == "disaggregated"
    sequential, concurrent = fake.decode_bodies
    assert not is_concurrent_decode(sequential)
    assert is_concurrent_decode(concurrent)
    kv = concurrent["kv_transfer_params"]
    assert (kv["remote_engine_id"], kv["remote_host"], kv["remote_port"], kv["tp_size"]) == (
        "engine-p",
        NIXL_PARAMS["remote_host"],
        NIXL_PARAMS["remote_port"],
        NIXL_PARAMS["tp_size"],
    )
    assert kv["remote_request_id"] == traces[1].leg_request_id  # vLLM's decode engine needs the key
    # Both legs of the concurrent call carry one request id: push mode matches them by it.
    prefill_ids = [c.request.headers["x-request-id"] for c in fake.router.routes["prefill"].calls]
    decode_ids = [c.request.headers["x-request-id"] for c in fake.router.routes["decode"].calls]
    assert prefill_ids == decode_ids
    await twin.close()


@pytest.mark.parametrize(("dispatch", "transfer_mode", "expected"), [
    ("auto", "pull", "sequential"),
    ("auto", None, "sequential"),
    ("concurrent", None, "concurrent"),
    ("concurrent", "pull", "sequential"),
    ("sequential", "push", "sequential"),
])  # fmt: skip
async def test_a_pull_pair_stays_sequential(
    mode: str, fake: FakeVLLM, dispatch: str, transfer_mode: str | None, expected: str
) -> None:
    fake.answers.kv_params = push_params(mode=transfer_mode)
    kwargs: dict[str, Any] = {"dispatch": dispatch}
    traces = traced(kwargs)
    twin = Twin(mode, **kwargs)
    for _ in range(2):
        await twin.chat(messages=MESSAGES, max_tokens=8)
    assert [t.dispatch for t in traces] == ["sequential", expected]
    await twin.close()


async def test_per_call_option_and_its_narrowing(mode: str, fake: FakeVLLM) -> None:
    fake.answers.kv_params = push_params()
    kwargs: dict[str, Any] = {"allow_call_overrides": False}
    traces = traced(kwargs)
    twin = Twin(mode, **kwargs)
    await twin.chat(messages=MESSAGES, max_tokens=8)
    with pytest.raises(openai.BadRequestError) as excinfo:
        await twin.chat(messages=MESSAGES, max_tokens=8, extra_body={"pdclient": {"dispatch": "concurrent"}})
    assert "pdclient.dispatch may be sequential here, not concurrent" in str(status_error(excinfo).message)
    with pytest.raises(openai.BadRequestError, match=r"pdclient\.dispatch must be one of"):
        await twin.chat(messages=MESSAGES, max_tokens=8, extra_body={"pdclient": {"dispatch": "fast"}})
    open_twin = Twin(mode, **{**kwargs, "allow_call_overrides": True})
    await open_twin.chat(messages=MESSAGES, max_tokens=8)
    await open_twin.chat(messages=MESSAGES, max_tokens=8, extra_body={"pdclient": {"dispatch": "concurrent"}})
    assert [t.dispatch for t in traces][-2:] == ["sequential", "concurrent"]
    await twin.close()
    await open_twin.close()


async def test_failed_prefill_cancels_the_decode_and_the_policy_applies(mode: str, fake: FakeVLLM) -> None:
    fake.answers.kv_params = push_params()
    kwargs: dict[str, Any] = {"dispatch": "concurrent"}
    traces = traced(kwargs)
    twin = Twin(mode, **kwargs)
    await twin.chat(messages=MESSAGES, max_tokens=8)
    fake.router.routes["prefill"].mock(return_value=httpx.Response(500, json={"error": {"message": "boom"}}))
    answer = await twin.chat(messages=MESSAGES, max_tokens=8)
    assert answer.choices[0].message.content == "echo:What is P/D?"
    trace = traces[-1]
    assert trace.dispatch == "sequential" and trace.outcome.value == "prefill_failed"
    assert trace.fallback is not None and "concurrent dispatch fell back to sequential: the prefill failed" in (
        trace.fallback
    )
    # The concurrent decode went out, then the decode-only one the "decode" policy sends.
    assert is_concurrent_decode(fake.decode_bodies[-2])
    assert "kv_transfer_params" not in fake.decode_bodies[-1]
    strict = Twin(mode, **{**kwargs, "on_prefill_failure": "fail"})
    fake.router.routes["prefill"].mock(side_effect=lambda request: fake.respond(request, at_prefill=True))
    await strict.chat(messages=MESSAGES, max_tokens=8)  # sequential: learns the coordinates
    fake.router.routes["prefill"].mock(return_value=httpx.Response(500, json={"error": {"message": "boom"}}))
    decodes = len(fake.decode_bodies)
    with pytest.raises(openai.InternalServerError):
        await strict.chat(messages=MESSAGES, max_tokens=8)
    assert len(fake.decode_bodies) == decodes + 1  # the concurrent decode, cancelled; none after it
    assert traces[-1].dispatch == "concurrent" and traces[-1].failed_leg == "prefill"
    await twin.close()
    await strict.close()


async def test_restarted_prefill_server_is_detected_and_the_decode_goes_again(mode: str, fake: FakeVLLM) -> None:
    fake.answers.kv_params = push_params("engine-before")
    kwargs: dict[str, Any] = {"dispatch": "concurrent"}  # ``auto`` would take turns while it learns
    traces = traced(kwargs)
    twin = Twin(mode, **kwargs)
    await twin.chat(messages=MESSAGES, max_tokens=8)
    fake.answers.kv_params = push_params("engine-after")  # restarted: a new engine id
    answer = await twin.chat(messages=MESSAGES, max_tokens=8)
    assert answer.choices[0].message.content == "echo:What is P/D?"
    assert traces[-1].fallback is not None and "engine engine-before -> engine-after" in traces[-1].fallback
    stale, again = fake.decode_bodies[-2:]
    assert is_concurrent_decode(stale) and stale["kv_transfer_params"]["remote_engine_id"] == "engine-before"
    # Sent again sequentially: the prefill's own params and its ids, as the plain handoff.
    assert again["kv_transfer_params"]["remote_engine_id"] == "engine-after"
    assert again["kv_transfer_params"]["prompt_token_ids"] == fake.answers.ids(fake.prefill_bodies[-1])
    await twin.chat(messages=MESSAGES, max_tokens=8)
    assert traces[-1].dispatch == "concurrent" and traces[-1].fallback is None
    assert fake.decode_bodies[-1]["kv_transfer_params"]["remote_engine_id"] == "engine-after"
    await twin.close()


async def test_failed_decode_goes_again_sequentially(mode: str, fake: FakeVLLM) -> None:
    fake.answers.kv_params = push_params()
    kwargs: dict[str, Any] = {"dispatch": "auto"}
    traces = traced(kwargs)
    twin = Twin(mode, **kwargs)
    await twin.chat(messages=MESSAGES, max_tokens=8)
    answers = iter([httpx.Response(503, json={"error": {"message": "busy"}})])
    fake.router.routes["decode"].mock(side_effect=lambda request: next(answers, None) or fake.respond(request))
    answer = await twin.chat(messages=MESSAGES, max_tokens=8)
    assert answer.choices[0].message.content == "echo:What is P/D?"
    assert traces[-1].fallback is not None and "the decode answered HTTP 503" in traces[-1].fallback
    # The sequential decode takes the prefill's KV (freeing its blocks) as the plain handoff does.
    assert "prompt_token_ids" in fake.decode_bodies[-1]["kv_transfer_params"]
    await twin.close()


async def test_streamed_answer_and_usage_merge(mode: str, fake: FakeVLLM) -> None:
    fake.answers.kv_params = push_params()
    kwargs: dict[str, Any] = {"dispatch": "auto"}
    traces = traced(kwargs)
    twin = Twin(mode, **kwargs)
    await twin.chat(messages=MESSAGES, max_tokens=8)
    pieces = await twin.stream_text(messages=MESSAGES, max_tokens=8, stream_options={"include_usage": True})
    assert "".join(pieces) == "echo:What is P/D?"
    assert traces[-1].dispatch == "concurrent" and traces[-1].forwarded_tokens == 0
    await twin.close()


async def test_a_leaving_caller_lets_the_concurrent_prefill_answer() -> None:
    """The caller leaves while both legs are out: the decode is cut at once, and the prefill
    is read to its end all the same (its WRITE is what frees a cut push decode's blocks in
    vLLM 0.32); the caller's cancel does not wait for it, closing the client does."""
    import asyncio

    from pdclient import AsyncPDTransport
    from tests.fake_vllm import DECODE, PREFILL, VLLMAnswers, is_prefill

    answers = VLLMAnswers(kv_params=push_params())
    ended: list[str] = []
    hold = {"prefill": 0.0, "decode": 0.0}

    async def legs(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        leg = "prefill" if is_prefill(body) else "decode"
        try:
            await asyncio.sleep(hold[leg])
        except asyncio.CancelledError:
            ended.append(f"{leg} cut")
            raise
        ended.append(f"{leg} answered")
        if leg == "prefill":
            return httpx.Response(200, json=answers.prefill(request.url.path, body))
        return httpx.Response(200, json=answers.decode(request.url.path, body))

    options = PDOptions(PREFILL, DECODE, dispatch="auto", remote_prefill="always")
    transport = AsyncPDTransport(options=options, leg_transport=httpx.MockTransport(legs))
    client = openai.AsyncOpenAI(
        base_url=DECODE, api_key="-", max_retries=0, http_client=httpx.AsyncClient(transport=transport)
    )
    await client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4)  # learns the coordinates
    ended.clear()
    hold.update(prefill=0.5, decode=30.0)
    call = asyncio.ensure_future(client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=4))
    await asyncio.sleep(0.1)
    started = asyncio.get_running_loop().time()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert asyncio.get_running_loop().time() - started < 0.2  # the cancel did not wait for the prefill
    assert ended == ["decode cut"]
    await client.close()  # waits for the prefill: closing its connection would abort it
    assert ended == ["decode cut", "prefill answered"]
