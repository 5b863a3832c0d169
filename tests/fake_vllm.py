"""The test suite's one fake vLLM: how a vLLM 0.32 P/D server answers, in process or on a socket.

``VLLMAnswers`` holds what a vLLM server says to a request body, as measured on vLLM
0.32 (the wire contract in docs/ARCHITECTURE.md):

- a body whose ``kv_transfer_params.do_remote_decode`` is true is a prefill: one sampled
  token, ``prompt_token_ids`` (top level for chat, ``choices[0]`` for completions), NIXL-
  shaped ``kv_transfer_params`` and ``usage``;
- any other chat or completions body is a decode: the answer's text, streamed (SSE, a
  role chunk first, a finish chunk last, a usage chunk when ``stream_options.include_usage``)
  or not; a tool call instead when tools are offered and no tool result came back yet.
  ``return_token_ids: true`` adds each chunk's ids (``choices[0].token_ids``: the answer's
  token ``i`` is ``ANSWER_ID + i``, the end of the answer ``EOS_ID``) and the prompt's in the
  first chunk, as vLLM 0.32 does. A prompt that ends with the answer's first ``k`` ids (a
  continuation: ``kv_transfer_params.prompt_token_ids`` on chat, an id ``prompt`` on
  completions) is answered from token ``k`` on; ``max_tokens`` bounds what a decode sends.

Two ways to serve it, one behaviour:

- ``FakeVLLM`` answers in process through respx (named routes ``prefill``, ``decode``,
  ``models``) and records every body: the mocked tier;
- ``StubServer`` (tests/stubserver.py) answers on a real loopback socket, with injectable
  faults: the stub tier and the benchmarks.
"""

from __future__ import annotations

import contextlib
import json
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

PREFILL = "http://prefill.test:8100/v1"
DECODE = "http://decode.test:8200/v1"
DECODE2 = "http://decode2.test:8200/v1"
MODEL = "stub-model"
VOCAB = 151_000  # ids in the range of a real tokenizer, so the JSON has realistic widths
ANSWER_ID = 160_000
"""The answer's token ``i`` has id ``ANSWER_ID + i``: outside every prompt's ids, so a
continuation's prompt shows how much of the answer it already holds."""
EOS_ID = 2
BAD_CONTINUATION = "<<not a continuation of this answer>>"
NIXL_BLOCK_SIZE = 16
NIXL_PARAMS: dict[str, Any] = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [3, 4],
    "remote_engine_id": "engine-p",
    "remote_request_id": "req-p",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}

Body = dict[str, Any]


def is_prefill(body: object) -> bool:
    kv = body.get("kv_transfer_params") if isinstance(body, dict) else None
    return isinstance(kv, dict) and bool(kv.get("do_remote_decode"))


def last_user_text(body: Body) -> str:
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    return str(body["prompt"])


def forwarded_ids(path: str, body: Body) -> list[Any] | None:
    """The ids a decode request carries: ``kv_transfer_params.prompt_token_ids`` (chat) or an id prompt."""
    if path.endswith("/chat/completions"):
        kv = body.get("kv_transfer_params")
        ids = kv.get("prompt_token_ids") if isinstance(kv, dict) else None
    else:
        prompt = body.get("prompt")
        ids = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else None
    return ids if isinstance(ids, list) else None


def answer_resume(ids: list[Any] | None) -> int | None:
    """How many of the answer's tokens a prompt ends with (0: none); None if its answer ids are not a prefix."""
    if not ids:
        return 0
    answer = [i - ANSWER_ID for i in ids if isinstance(i, int) and i >= ANSWER_ID]
    if not answer:
        return 0
    k = len(answer)
    return k if answer == list(range(k)) and ids[-k:] == [ANSWER_ID + i for i in range(k)] else None


def wants_ids(body: Body) -> bool:
    return body.get("return_token_ids") is True


# -- what the ids and the answer are, per configuration ------------------------------------


def ids_for(text: str) -> list[int]:
    """Readable fake ids of a prompt text: one per character (distinct prompts, distinct ids)."""
    return [ord(c) for c in text]


def ids_of_last_message(body: Body) -> list[int]:
    return ids_for(last_user_text(body))


def ids_of_conversation(body: Body) -> list[int]:
    """One id per character of the whole rendered request (messages and prompt)."""
    text = json.dumps(body.get("messages") or body.get("prompt"), sort_keys=True)
    return [ord(c) % 1000 for c in text]


def seed_of(body: Body) -> int:
    """A request's signature: the first id a stub prefill of it returns."""
    shape = body.get("messages") if "messages" in body else body.get("prompt")
    return zlib.crc32(json.dumps(shape, separators=(",", ":"), sort_keys=True).encode()) % VOCAB


def echo(body: Body) -> str:
    return f"echo:{last_user_text(body)}"


@dataclass
class VLLMAnswers:
    """What a vLLM server answers to a request body (see the module docstring)."""

    ids: Callable[[Body], list[int]] = ids_of_last_message
    text: Callable[[Body], str] = echo
    pieces: Callable[[str], list[str]] = lambda text: [text[:3], text[3:]]
    kv_params: Callable[[str, int], dict[str, Any] | None] = lambda request_id, n: dict(NIXL_PARAMS)
    tool_arguments: dict[str, Any] = field(default_factory=lambda: {"city": "Paris"})

    def prefill(self, path: str, body: Body, request_id: str = "req-p") -> Body:
        # Ids given as the prompt (chat: next to do_remote_decode) are used as they are.
        ids = forwarded_ids(path, body) or self.ids(body)
        usage = {"prompt_tokens": len(ids), "completion_tokens": 1, "total_tokens": len(ids) + 1}
        base = {"id": f"cmpl-{request_id}", "created": 1, "model": body.get("model", MODEL), "usage": usage}
        kv = self.kv_params(request_id, len(ids))
        if path.endswith("/chat/completions"):
            message = {"role": "assistant", "content": "x"}
            choice = {"index": 0, "message": message, "finish_reason": "length", "logprobs": None, "token_ids": [9]}
            return {
                **base,
                "object": "chat.completion",
                "choices": [choice],
                "prompt_token_ids": ids,
                "kv_transfer_params": kv,
            }
        choice = {"index": 0, "text": "x", "finish_reason": "length", "prompt_token_ids": ids, "token_ids": [9]}
        return {**base, "object": "text_completion", "choices": [choice], "kv_transfer_params": kv}

    def tool_call(self, body: Body) -> Body | None:
        """The tool call to answer with: when tools are offered and no tool result came back yet."""
        tools = body.get("tools") or []
        if not tools or body.get("tool_choice") == "none":
            return None
        if any(m.get("role") == "tool" for m in body.get("messages", [])):
            return None
        choice = body.get("tool_choice")
        name = choice["function"]["name"] if isinstance(choice, dict) else tools[0]["function"]["name"]
        arguments = json.dumps(self.tool_arguments)
        return {"id": "call_1", "type": "function", "function": {"name": name, "arguments": arguments}}

    def usage(self, path: str, body: Body) -> dict[str, int]:
        # A decode-only call's prompt counts as a prefill of it would.
        prompt = len(forwarded_ids(path, body) or self.ids(body))
        completion = len(self._answer(path, body)[0]) if wants_ids(body) else len(self.pieces(self.text(body)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _answer(self, path: str, body: Body) -> tuple[list[tuple[int, str]], str]:
        """The (token id, text) pieces this decode sends, and its finish reason."""
        pieces = self.pieces(self.text(body))
        resume = answer_resume(forwarded_ids(path, body))
        if resume is None:
            return [(0, BAD_CONTINUATION)], "stop"
        tokens = [(ANSWER_ID + i, piece) for i, piece in enumerate(pieces)][resume:]
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        if isinstance(limit, int) and len(tokens) > limit:
            return tokens[:limit], "length"
        return tokens, "stop"

    def decode(self, path: str, body: Body) -> Body:
        chat = path.endswith("/chat/completions")
        call = self.tool_call(body) if chat else None
        if not chat:
            choice: Body = {"index": 0, "text": self.text(body), "finish_reason": "stop", "logprobs": None}
        elif call is not None:
            message = {"role": "assistant", "content": None, "tool_calls": [call]}
            choice = {"index": 0, "message": message, "finish_reason": "tool_calls", "logprobs": None}
        else:
            message = {"role": "assistant", "content": self.text(body)}
            choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
        return {
            "id": "chatcmpl-d" if chat else "cmpl-d",
            "object": "chat.completion" if chat else "text_completion",
            "created": 1,
            "model": body.get("model", MODEL),
            "choices": [choice],
            "usage": self.usage(path, body),
        }

    def decode_events(self, path: str, body: Body) -> list[Body]:
        """The SSE events of a streamed decode, without the final ``[DONE]``."""
        chat = path.endswith("/chat/completions")
        base = {
            "id": "chatcmpl-d" if chat else "cmpl-d",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": 1,
            "model": body.get("model", MODEL),
        }

        ids = wants_ids(body)

        def event(delta: Body | str, finish: str | None = None, token_ids: list[int] | None = None) -> Body:
            if chat:
                choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None}
            if ids and token_ids is not None:
                choice["token_ids"] = token_ids
            return {**base, "choices": [choice]}

        call = self.tool_call(body) if chat else None
        if call is not None:
            events = [event({"role": "assistant", "tool_calls": [{"index": 0, **call}]}), event({}, "tool_calls")]
        elif not ids:
            pieces = self.pieces(self.text(body))
            if chat:
                events = [event({"role": "assistant", "content": pieces[0]})]
                events += [event({"content": piece}) for piece in pieces[1:]]
                events.append(event({}, "stop"))
            else:
                events = [event(piece) for piece in pieces] + [event("", "stop")]
        else:
            # As vLLM streams with return_token_ids: a role chunk with the prompt's ids, one
            # chunk per token (its text may be empty), the finish chunk with the last id.
            tokens, finish = self._answer(path, body)
            prompt_ids = forwarded_ids(path, body) or self.ids(body)
            end = [EOS_ID] if finish == "stop" else []
            if chat:
                events = [{**event({"role": "assistant", "content": ""}), "prompt_token_ids": prompt_ids}]
                events += [event({"content": piece}, None, [token]) for token, piece in tokens]
                events.append(event({}, finish, end))
            else:
                events = [event(piece, None, [token]) for token, piece in tokens] + [event("", finish, end)]
                events[0]["choices"][0]["prompt_token_ids"] = prompt_ids
        options = body.get("stream_options")
        if isinstance(options, dict) and options.get("include_usage"):
            events.append({**base, "choices": [], "usage": self.usage(path, body)})
        return events

    @staticmethod
    def models() -> Body:
        return {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "fake-vllm"}]}


def sse_frames(events: list[Body]) -> list[bytes]:
    """One SSE frame per event, compact as vLLM writes them, then ``[DONE]``."""
    return [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events] + [b"data: [DONE]\n\n"]


def sse_events(events: list[Body]) -> bytes:
    return b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"


class CutStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A response body that sends ``frames`` and then breaks, as a decode server that died mid-answer."""

    def __init__(self, frames: list[bytes], error: Exception | None = None) -> None:
        self.frames = frames
        self.error = error or httpx.RemoteProtocolError("peer closed connection without sending complete message body")

    def __iter__(self) -> Iterator[bytes]:
        yield from self.frames
        raise self.error

    async def __aiter__(self) -> Any:
        for frame in self.frames:
            yield frame
        raise self.error


# -- in process, through respx ---------------------------------------------------------------


@dataclass
class FakeVLLM:
    """A fake prefill/decode pair answered in process through respx; records every body."""

    answers: VLLMAnswers = field(default_factory=VLLMAnswers)
    prefill_bodies: list[Body] = field(default_factory=list)
    decode_bodies: list[Body] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    """The base URL each decode body went to."""
    warm_up_bodies: list[Body] = field(default_factory=list)
    """Plain calls (no ``do_remote_decode``) to the prefill endpoint: prefill warm-ups (pdclient/fleet/_warm.py)."""
    cuts: list[int] = field(default_factory=list)
    """Streamed decodes to break, in order: each sends this many SSE frames, then its connection drops."""
    router: Any = None
    """The respx router: change a route's answer in a test with ``router.routes["decode"].mock(...)``."""

    @property
    def answer(self) -> str:
        return self.answers.text({})

    def respond(self, request: httpx.Request, *, at_prefill: bool = False) -> httpx.Response:
        body = json.loads(request.content)
        path = request.url.path
        if is_prefill(body):
            self.prefill_bodies.append(body)
            return httpx.Response(200, json=self.answers.prefill(path, body))
        if at_prefill:
            self.warm_up_bodies.append(body)
            return httpx.Response(200, json=self.answers.decode(path, body))
        self.decode_bodies.append(body)
        self.decode_urls.append(str(request.url).rsplit(path.removeprefix("/v1"), 1)[0])
        if body.get("stream"):
            events = self.answers.decode_events(path, body)
            headers = {"content-type": "text/event-stream"}
            if self.cuts:
                return httpx.Response(200, stream=CutStream(sse_frames(events)[: self.cuts.pop(0)]), headers=headers)
            return httpx.Response(200, content=sse_events(events), headers=headers)
        return httpx.Response(200, json=self.answers.decode(path, body))

    @contextlib.contextmanager
    def routes(self, prefill_url: str, decode_url: str, *more_decode_urls: str) -> Iterator[Any]:
        """respx routes ``prefill`` and ``decode`` (chat and completions) and ``models``; yields the router.

        ``more_decode_urls``: further decode endpoints answering alike (routes ``decode2``, ...).
        """
        import respx

        def at_prefill(request: httpx.Request) -> httpx.Response:
            return self.respond(request, at_prefill=True)

        with respx.mock(assert_all_called=False) as router:
            self.router = router
            router.post(f"{prefill_url}/chat/completions", name="prefill").mock(side_effect=at_prefill)
            router.post(f"{decode_url}/chat/completions", name="decode").mock(side_effect=self.respond)
            router.post(f"{prefill_url}/completions", name="prefill_completions").mock(side_effect=at_prefill)
            router.post(f"{decode_url}/completions", name="decode_completions").mock(side_effect=self.respond)
            for n, url in enumerate(more_decode_urls, start=2):
                router.post(f"{url}/chat/completions", name=f"decode{n}").mock(side_effect=self.respond)
                router.post(f"{url}/completions", name=f"decode{n}_completions").mock(side_effect=self.respond)
            router.get(f"{decode_url}/models", name="models").mock(
                return_value=httpx.Response(200, json=self.answers.models())
            )
            yield router

    def assert_handoffs(self, count: int) -> None:
        """``count`` calls each went prefill -> decode with the prefill's ids forwarded."""
        assert len(self.prefill_bodies) == count, self.prefill_bodies
        assert len(self.decode_bodies) == count, self.decode_bodies
        for prefill, decode in zip(self.prefill_bodies, self.decode_bodies, strict=True):
            assert prefill["max_tokens"] == 1 and prefill["stream"] is False
            assert decode["kv_transfer_params"]["prompt_token_ids"] == self.answers.ids(prefill)
            assert decode["kv_transfer_params"]["remote_engine_id"] == NIXL_PARAMS["remote_engine_id"]


# -- single responses, for tests that build their own --------------------------------------------


def prefill_json(body: Body, *, kv_params: dict[str, Any] | None = NIXL_PARAMS) -> Body:
    """A chat (or completions) prefill answer for ``body`` with readable ids."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    answers = VLLMAnswers(kv_params=lambda request_id, n: None if kv_params is None else dict(kv_params))
    return answers.prefill(path, body)


def chat_json(content: str, model: str = "m") -> Body:
    message = {"role": "assistant", "content": content}
    return {
        "id": "cmpl-d",
        "object": "chat.completion",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
    }


def chat_chunk(content: str, model: str = "m") -> bytes:
    chunk = {
        "id": "cmpl-d",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": model,
        "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


def sse(*pieces: str) -> bytes:
    """A streamed chat answer of these content pieces, as the SSE body bytes."""
    return b"".join(chat_chunk(p) for p in pieces) + b"data: [DONE]\n\n"
