"""The Responses and Messages routes' own render steps, per vLLM version, without an engine.

Both routes end in the chat renderer's ``preprocess_chat``; what differs by version is the
step before it. Responses: ``OnlineRenderer.render_responses`` on 0.32; on 0.20 / 0.26,
``construct_input_messages`` then ``preprocess_chat``, as ``OpenAIServingResponses._make_request``
does. Messages: vLLM's classmethod converting the Anthropic request to a chat request
(``to_chat_completion_request`` on 0.32, ``_convert_anthropic_to_openai_request`` before),
then the chat path. Used by the tests and by benchmarks/bench_server_preprocess.py.
"""

from __future__ import annotations

from typing import Any


async def render_responses(chat: Any, request: Any) -> dict[str, Any]:
    """The engine input vLLM's Responses route builds for ``request`` (a ResponsesRequest)."""
    if hasattr(chat, "render_responses"):  # 0.32
        result = await chat.render_responses(request)
        if hasattr(result, "error"):  # an ErrorResponse
            raise RouteError(result)
        return dict(result.engine_input)
    from vllm.entrypoints.openai.responses.utils import construct_input_messages

    messages = construct_input_messages(request_instructions=request.instructions, request_input=request.input)
    _, (engine_input,) = await chat.preprocess_chat(
        request, messages, default_template=None, default_template_content_format="auto", default_template_kwargs=None
    )
    return dict(engine_input)


def messages_to_chat(request: Any) -> Any:
    """vLLM's own conversion of an AnthropicMessagesRequest to the chat request it renders."""
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages

    convert = getattr(AnthropicServingMessages, "to_chat_completion_request", None)
    if convert is None:
        convert = AnthropicServingMessages._convert_anthropic_to_openai_request
    return convert(request)


class RouteError(Exception):
    """The route answered an ErrorResponse (``.args[0]``) instead of raising."""
