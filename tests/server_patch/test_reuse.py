"""Reuse of forwarded ids against the real chat renderer of each vLLM version.

The same assertions hold on 0.20.2 and 0.26.0 (patched by the plugin) and on 0.32.0
(native): that is the point - the plugin gives old versions the native semantics.
"""

from __future__ import annotations

import asyncio
import copy
from typing import Any

import pytest
from _aio import arun

PARAM = "kv_transfer_params.prompt_token_ids"
TRANSFER = {"do_remote_prefill": True, "remote_engine_id": "e1", "remote_block_ids": [1, 2], "remote_host": "h"}
HELLO = [{"role": "user", "content": "Hello!"}]
OTHER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


def chat_request(messages: list[dict[str, Any]], ids: Any = None, **extra: Any) -> Any:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    kv = copy.deepcopy(TRANSFER)
    if ids is not None:
        kv["prompt_token_ids"] = ids
    return ChatCompletionRequest.model_validate(
        {"model": "smol", "messages": messages, "kv_transfer_params": kv, **extra}
    )


def render(chat: Any, request: Any) -> Any:
    return arun(chat.render_chat(request))


class Spy:
    """Counts calls to the renderer's template and tokenizer steps, still delegating."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, renderer: Any) -> None:
        self.templated = self.encoded = 0
        real_render, real_encode = renderer.render_messages_async, renderer._tokenize_prompt_async

        async def render_messages_async(*a: Any, **k: Any) -> Any:
            self.templated += 1
            return await real_render(*a, **k)

        async def tokenize_prompt_async(*a: Any, **k: Any) -> Any:
            self.encoded += 1
            return await real_encode(*a, **k)

        # Instance attributes: vLLM binds _tokenize_prompt_async per instance.
        monkeypatch.setattr(renderer, "render_messages_async", render_messages_async)
        monkeypatch.setattr(renderer, "_tokenize_prompt_async", tokenize_prompt_async)


@pytest.fixture(scope="module")
def other_ids(chat: Any) -> list[int]:
    """The server's own ids for OTHER: different from anything HELLO renders to."""
    _, (engine_input,) = render(chat, chat_request(OTHER))
    return list(engine_input["prompt_token_ids"])


def test_forwarded_ids_reach_the_engine_input_without_template_or_encode(
    chat: Any, other_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = Spy(monkeypatch, chat.renderer)
    request = chat_request(HELLO, other_ids, cache_salt="salt-1")
    conversation, engine_inputs = render(chat, request)
    (engine_input,) = engine_inputs
    assert engine_input["prompt_token_ids"] == other_ids  # not HELLO's rendering
    assert engine_input.get("cache_salt") == "salt-1"
    assert conversation == []
    assert (spy.templated, spy.encoded) == (0, 0)
    # The key is popped (it must not reach sampling metadata); the connector's keys stay.
    assert request.kv_transfer_params == TRANSFER


def test_spy_sees_a_normal_render(chat: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch, chat.renderer)
    _, (engine_input,) = render(chat, chat_request(HELLO))
    assert (spy.templated, spy.encoded) == (1, 1)
    tokenizer = chat.renderer.tokenizer
    text = tokenizer.apply_chat_template(HELLO, tokenize=False, add_generation_prompt=True)
    assert engine_input["prompt_token_ids"] == tokenizer.encode(text, add_special_tokens=False)


def test_echo_falls_through_and_pops_the_key(chat: Any, other_ids: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    spy = Spy(monkeypatch, chat.renderer)
    request = chat_request(HELLO, other_ids, echo=True)
    _, (engine_input,) = render(chat, request)
    assert engine_input["prompt_token_ids"] != other_ids
    assert spy.encoded == 1
    assert "prompt_token_ids" not in request.kv_transfer_params


def test_media_falls_through(chat: Any, other_ids: list[int], monkeypatch: pytest.MonkeyPatch) -> None:
    class Rendered(Exception):
        pass

    async def render_messages_async(*a: Any, **k: Any) -> Any:
        raise Rendered  # SmolLM2 is text-only: stop once the real render is reached

    monkeypatch.setattr(chat.renderer, "render_messages_async", render_messages_async)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    request = chat_request([{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}], other_ids)
    with pytest.raises(Rendered):
        render(chat, request)
    assert "prompt_token_ids" not in request.kv_transfer_params


def test_text_parts_still_reuse(chat: Any, other_ids: list[int]) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hello!"}]}]
    _, (engine_input,) = render(chat, chat_request(messages, other_ids))
    assert engine_input["prompt_token_ids"] == other_ids


def test_already_tokenized_completion_prompt_falls_through(chat: Any, other_ids: list[int]) -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    prompt_ids = other_ids[:5]
    request = CompletionRequest.model_validate(
        {"model": "smol", "prompt": prompt_ids, "kv_transfer_params": {**TRANSFER, "prompt_token_ids": other_ids}}
    )
    (engine_input,) = arun(chat.render_completion(request))
    assert engine_input["prompt_token_ids"] == prompt_ids


@pytest.mark.parametrize(
    "bad",
    [[], [1.5], ["7"], [True], [-1], "1 2 3", {"0": 1}, [10**9]],
    ids=["empty", "float", "str", "bool", "negative", "not-a-list", "dict", "out-of-vocab"],
)
def test_bad_ids_are_a_400_naming_the_parameter(chat: Any, bad: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.exceptions import VLLMValidationError

    spy = Spy(monkeypatch, chat.renderer)
    with pytest.raises(VLLMValidationError) as info:
        render(chat, chat_request(HELLO, bad))
    assert info.value.parameter == PARAM
    assert (spy.templated, spy.encoded) == (0, 0)
    assert_http_400(info.value)


def test_ids_longer_than_the_context(chat: Any, vllm_version: str, plugin: Any) -> None:
    from vllm.exceptions import VLLMValidationError

    too_long = [1] * (chat.model_config.max_model_len + 1)
    if plugin.STATE.applied["reuse"].startswith("native"):
        # vLLM 0.27+ lets the renderer pass them and rejects them a step later (400
        # "exceeds model's maximum context length" from get_max_tokens; the live test
        # checks the HTTP status). The plugin does not change native behaviour.
        _, (engine_input,) = render(chat, chat_request(HELLO, too_long))
        assert len(engine_input["prompt_token_ids"]) == len(too_long)
        return
    with pytest.raises(VLLMValidationError) as info:
        render(chat, chat_request(HELLO, too_long))
    assert info.value.parameter == PARAM
    assert_http_400(info.value)


def test_tool_choice_validation_still_runs(chat: Any, other_ids: list[int]) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    request = chat_request(HELLO, other_ids, tools=[tool], tool_choice="required")
    result = render(chat, request)  # no --tool-call-parser on this server
    assert getattr(result, "error", None) is not None and result.error.code == 400


def test_adjust_request_tail_still_runs(chat: Any, other_ids: list[int], plugin: Any) -> None:
    """The reasoning/tool parsers' adjust_request runs after the reused ids, as natively."""
    adjusted = []

    class Parser:  # the parts of vLLM's parser interface preprocess_chat touches
        tool_parser_cls = None
        reasoning_parser_cls = object
        always_adjust_request = True

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            pass

        def adjust_request(self, request: Any) -> Any:
            adjusted.append(request)
            return request

    request = chat_request(HELLO, other_ids)
    name = "reasoning_parser" if type(chat).__name__ == "OpenAIServingRender" else "parser"  # 0.20 vs 0.26+
    _, (engine_input,) = arun(chat.preprocess_chat(request, request.messages, None, "auto", None, **{name: Parser}))
    assert engine_input["prompt_token_ids"] == other_ids
    assert adjusted == [request]


def test_harmony_path(chat: Any, other_ids: list[int]) -> None:
    from vllm.exceptions import VLLMValidationError

    request = chat_request(HELLO, other_ids, cache_salt="s")
    messages, (engine_input,) = chat._make_request_with_harmony(request)
    assert (messages, engine_input["prompt_token_ids"], engine_input.get("cache_salt")) == ([], other_ids, "s")
    assert "prompt_token_ids" not in request.kv_transfer_params
    with pytest.raises(VLLMValidationError):
        chat._make_request_with_harmony(chat_request(HELLO, [-1]))


def test_concurrent_requests_keep_their_own_ids(chat: Any, other_ids: list[int]) -> None:
    async def both() -> list[Any]:
        return await asyncio.gather(
            chat.render_chat(chat_request(HELLO, other_ids)),
            chat.render_chat(chat_request(OTHER, other_ids[:-3])),
            chat.render_chat(chat_request(HELLO)),
        )

    results = arun(both())
    got = [r[1][0]["prompt_token_ids"] for r in results]
    assert got[0] == other_ids and got[1] == other_ids[:-3] and got[2] != other_ids


def test_batched_render_falls_through(chat: Any, other_ids: list[int], plugin: Any) -> None:
    """Several conversations in one render_chat_async call are never given reused ids."""
    if plugin.STATE.applied["reuse"].startswith("native"):
        pytest.skip("native vLLM: no render_chat_async wrapper to test")
    from pdclient_server_patch import _reuse
    from vllm.renderers.base import BaseRenderer

    renderer = chat.renderer
    params = chat_request(HELLO).build_chat_params(None, "auto")
    token = _reuse._REUSE_IDS.set(other_ids)
    try:
        _, engine_inputs = arun(
            BaseRenderer.render_chat_async(renderer, [HELLO, OTHER], params, renderer.default_chat_tok_params)
        )
    finally:
        _reuse._REUSE_IDS.reset(token)
    assert len(engine_inputs) == 2
    assert engine_inputs[1]["prompt_token_ids"] == other_ids  # OTHER rendered for real
    assert engine_inputs[0]["prompt_token_ids"] != other_ids


def assert_http_400(exc: Exception) -> None:
    """vLLM's own error conversion turns it into a 400 naming the parameter."""
    response = _create_error_response()(exc)
    assert response.error.code == 400
    assert response.error.param == PARAM


def _create_error_response() -> Any:
    import importlib

    for module_name in (
        "vllm.entrypoints.serve.exception_handling.error_response",  # 0.32
        "vllm.entrypoints.serve.utils.error_response",  # 0.26
        "vllm.entrypoints.utils",  # 0.20
    ):
        try:
            return importlib.import_module(module_name).create_error_response
        except (ImportError, AttributeError):
            continue
    raise AssertionError("create_error_response not found")
