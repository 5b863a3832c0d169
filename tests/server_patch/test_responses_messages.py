"""Responses (/v1/responses) and Anthropic Messages (/v1/messages) on each vLLM version.

Both routes exist, with a ``kv_transfer_params`` request field, on 0.20.2, 0.26.0 and
0.32.0, and both render through the chat renderer's ``preprocess_chat``: Responses
directly (0.32: through ``OnlineRenderer.render_responses``), Messages after converting to
a chat request (the converter copies ``kv_transfer_params``). So forwarded ids are reused
on these routes as on chat: natively on 0.32, by the plugin on 0.20 and 0.26. The route
code used here is vLLM's own (request models, Responses input construction, the Messages
converter); only the engine is absent.

The prefill side (``return_prompt_token_ids``) is a scheduler hook: checked here on the
real ``Scheduler`` class of each version, and on a real 0.32 NIXL pair by
``tools/check_prompt_ids_pair.py``.
"""

from __future__ import annotations

import copy
import inspect
from types import SimpleNamespace
from typing import Any

import _routes as routes
import pytest
from _aio import arun
from test_reuse import PARAM, TRANSFER, assert_http_400, chat_request, render

INPUT = "What is 2+2?"


# --- Responses -------------------------------------------------------------------


def responses_request(ids: Any = None, **extra: Any) -> Any:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest

    kv = copy.deepcopy(TRANSFER)
    if ids is not None:
        kv["prompt_token_ids"] = ids
    body = {"model": "smol", "input": INPUT, "instructions": "Be brief.", "kv_transfer_params": kv, **extra}
    return ResponsesRequest.model_validate(body)


def render_responses(chat: Any, request: Any) -> list[int]:
    """The engine input's ids, rendered the way this version's Responses route renders."""
    return list(arun(routes.render_responses(chat, request))["prompt_token_ids"])


@pytest.fixture(scope="module")
def responses_ids(chat: Any) -> list[int]:
    return render_responses(chat, responses_request())


def test_responses_route_has_kv_transfer_params(vllm_version: str) -> None:
    from vllm.entrypoints.openai.responses.protocol import ResponsesRequest, ResponsesResponse

    assert "kv_transfer_params" in ResponsesRequest.model_fields
    assert "kv_transfer_params" in ResponsesResponse.model_fields


def test_responses_render_matches_chat_of_the_same_messages(chat: Any, responses_ids: list[int]) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": INPUT}]
    _, (engine_input,) = render(chat, chat_request(messages))
    assert responses_ids == list(engine_input["prompt_token_ids"])


def test_responses_forwarded_ids_are_reused(chat: Any, responses_ids: list[int]) -> None:
    other = responses_ids[:-3]  # any valid list, different from the render
    request = responses_request(other)
    assert render_responses(chat, request) == other
    assert request.kv_transfer_params == TRANSFER  # popped: never reaches the engine


@pytest.mark.parametrize("bad", [[], [-1], ["1"], [True], [10**9]], ids=["empty", "negative", "str", "bool", "oov"])
def test_responses_bad_ids_are_a_400_naming_the_parameter(chat: Any, bad: Any) -> None:
    assert_400(lambda: render_responses(chat, responses_request(bad)))


def assert_400(call: Any) -> None:
    """A VLLMValidationError that vLLM turns into a 400 naming the parameter (or that 400 itself)."""
    from vllm.exceptions import VLLMValidationError

    try:
        call()
    except VLLMValidationError as exc:
        assert_http_400(exc)
    except routes.RouteError as returned:
        error = returned.args[0].error
        assert (error.code, error.param) == (400, PARAM), error
    else:
        raise AssertionError("no 400")


def test_responses_without_ids_and_with_the_flag_render_normally(chat: Any, responses_ids: list[int]) -> None:
    request = responses_request()
    request.kv_transfer_params["return_prompt_token_ids"] = True
    assert render_responses(chat, request) == responses_ids
    assert request.kv_transfer_params["return_prompt_token_ids"] is True  # left for the engine's hook


# --- Messages --------------------------------------------------------------------


def messages_to_chat(ids: Any = None, **extra: Any) -> Any:
    """vLLM's own Anthropic request model and converter to a chat request."""
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest

    kv = copy.deepcopy(TRANSFER)
    if ids is not None:
        kv["prompt_token_ids"] = ids
    body = {"model": "smol", "max_tokens": 8, "system": "Be brief.", "kv_transfer_params": kv, **extra}
    body.setdefault("messages", [{"role": "user", "content": INPUT}])
    request = AnthropicMessagesRequest.model_validate(body)
    return routes.messages_to_chat(request)


def test_messages_route_has_kv_transfer_params(vllm_version: str) -> None:
    from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest, AnthropicMessagesResponse

    assert "kv_transfer_params" in AnthropicMessagesRequest.model_fields
    assert "kv_transfer_params" in AnthropicMessagesResponse.model_fields


def test_messages_forwarded_ids_are_reused(chat: Any, responses_ids: list[int]) -> None:
    _, (plain,) = render(chat, messages_to_chat())
    assert list(plain["prompt_token_ids"]) == responses_ids  # same conversation, same prompt
    other = responses_ids[:-3]
    request = messages_to_chat(other)
    _, (engine_input,) = render(chat, request)
    assert list(engine_input["prompt_token_ids"]) == other
    assert request.kv_transfer_params == TRANSFER


def test_messages_bad_ids_are_a_400(chat: Any) -> None:
    assert_400(lambda: render(chat, messages_to_chat([-1])))


def test_messages_image_falls_through_to_a_render(chat: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    class Rendered(Exception):
        pass

    async def render_messages_async(*a: Any, **k: Any) -> Any:
        raise Rendered  # SmolLM2 is text-only: stop once the real render is reached

    monkeypatch.setattr(chat.renderer, "render_messages_async", render_messages_async)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    content = [image, {"type": "text", "text": "What is this?"}]
    request = messages_to_chat([5, 6, 7], messages=[{"role": "user", "content": content}])
    with pytest.raises(Rendered):
        render(chat, request)
    assert "prompt_token_ids" not in request.kv_transfer_params


# --- the prefill side: the scheduler hook ------------------------------------------


def test_scheduler_hook_is_installed_on_every_version(plugin: Any) -> None:
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    assert plugin.STATE.applied["prompt ids"].startswith("on"), plugin.STATE.applied
    hook = Scheduler._connector_finished
    assert "prompt ids" in hook.__pdclient_layers__
    assert AsyncScheduler._connector_finished is hook  # inherited, not overridden
    # The wrapped vLLM method keeps the contract the hook relies on: (self, request) -> (bool, params).
    assert list(inspect.signature(hook.__wrapped__).parameters) == ["self", "request"]


def engine_request(kv: dict[str, Any] | None, ids: list[int]) -> Any:
    """A real engine Request, built the way the engine core builds it from sampling params."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": kv} if kv is not None else None)
    wanted = inspect.signature(Request).parameters
    args: dict[str, Any] = {"request_id": "r1", "prompt_token_ids": ids, "sampling_params": params}
    for name, default in (("pooling_params", None), ("eos_token_id", 2), ("arrival_time", 0.0)):
        if name in wanted:
            args[name] = default
    for name in ("multi_modal_inputs", "multi_modal_hashes", "multi_modal_placeholders", "mm_features"):
        if name in wanted and wanted[name].default is inspect.Parameter.empty:
            args[name] = None
    return Request(**args)


class Connector:
    """Stands in for a KV connector: returns its params for a finished prefill."""

    def __init__(self, params: dict[str, Any] | None) -> None:
        self.params = params

    def __call__(self, scheduler: Any, request: Any) -> tuple[bool, dict[str, Any] | None]:
        return True, self.params


NIXL_ANSWER = {"do_remote_prefill": True, "remote_engine_id": "e", "remote_block_ids": [3], "remote_host": "h"}


@pytest.mark.parametrize(
    ("kv", "connector_answer", "expect_ids"),
    [
        ({"do_remote_decode": True, "return_prompt_token_ids": True}, NIXL_ANSWER, True),
        ({"do_remote_decode": True}, NIXL_ANSWER, False),
        ({"do_remote_decode": True, "return_prompt_token_ids": "yes"}, NIXL_ANSWER, False),
        ({"do_remote_decode": True, "return_prompt_token_ids": True}, None, False),  # no params: a plain server
        (None, NIXL_ANSWER, False),
    ],
)
def test_scheduler_hook_adds_the_engine_requests_ids(
    plugin: Any, kv: Any, connector_answer: Any, expect_ids: bool
) -> None:
    from pdclient_server_patch._prompt_ids import wrap_connector_finished

    ids = [1, 9, 42, 7]
    request = engine_request(kv, ids)
    assert request.kv_transfer_params == kv  # the engine's own reading of the sampling params
    delay, params = wrap_connector_finished(Connector(connector_answer))(SimpleNamespace(), request)
    assert delay is True
    if expect_ids:
        assert params == {**NIXL_ANSWER, "prompt_token_ids": ids}
        assert "prompt_token_ids" not in NIXL_ANSWER  # the connector's own dict is left alone
    else:
        assert params == connector_answer


def test_real_scheduler_without_a_connector_returns_nothing(plugin: Any) -> None:
    from vllm.v1.core.sched.scheduler import Scheduler

    request = engine_request({"do_remote_decode": True, "return_prompt_token_ids": True}, [1, 2])
    # Every supported version starts with "no connector: (False, None)".
    assert Scheduler._connector_finished(SimpleNamespace(connector=None), request) == (False, None)
