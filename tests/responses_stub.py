"""A loopback vLLM pair for the Responses API whose streamed events are long.

vLLM echoes the whole response object (its ``instructions`` among them) in the lifecycle
events of a streamed Responses answer (``response.created``, ``.in_progress``,
``.completed``), so a long ``instructions`` makes each of those events as long. The stub
answers ``POST /v1/responses`` as both legs: a body asking for ``do_remote_decode`` is a
prefill (JSON, the prompt's ids in its ``kv_transfer_params``), any other a decode,
streamed in small writes so that an event arrives over many network reads. ``padding``
adds that many bytes to every lifecycle event (an event longer than a caller could send).
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from tests.fake_vllm import NIXL_PARAMS

PREFILL_USAGE = {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 0}}
"""The prompt side the prefill reports: the caller's usage carries it (the usage merge)."""
DECODE_INPUT_TOKENS = 99
TEXT = ["Hel", "lo"]
WRITE = 16 << 10
"""Bytes per write of a streamed answer, a short pause after each: the reader gets them one by one."""
PAUSE = 0.0005


def _response(response_id: str, body: dict[str, Any], status: str, padding: int) -> dict[str, Any]:
    message = {"type": "message", "id": "msg_1", "role": "assistant", "status": "completed"}
    message["content"] = [{"type": "output_text", "text": "".join(TEXT), "annotations": []}]
    usage = {"input_tokens": DECODE_INPUT_TOKENS, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 2}
    usage |= {"output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": DECODE_INPUT_TOKENS + 2}
    response: dict[str, Any] = {
        "id": response_id,
        "object": "response",
        "created_at": 1,
        "model": body.get("model", "m"),
        "status": status,
        "instructions": body.get("instructions"),
        "previous_response_id": body.get("previous_response_id"),
        "output": [message] if status == "completed" else [],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": usage if status == "completed" else None,
        "metadata": {"padding": "x" * padding} if padding else None,
    }
    return response


def events(response_id: str, body: dict[str, Any], padding: int) -> list[dict[str, Any]]:
    """A streamed answer's events, as vLLM's Responses server sends them."""
    item = {"type": "message", "id": "msg_1", "role": "assistant", "status": "in_progress", "content": []}
    part = {"type": "output_text", "text": "", "annotations": []}
    where = {"item_id": "msg_1", "output_index": 0, "content_index": 0}
    done_item = {**item, "status": "completed", "content": [{**part, "text": "".join(TEXT)}]}
    return [
        {"type": "response.created", "response": _response(response_id, body, "in_progress", padding)},
        {"type": "response.in_progress", "response": _response(response_id, body, "in_progress", padding)},
        {"type": "response.output_item.added", "output_index": 0, "item": item},
        {"type": "response.content_part.added", **where, "part": part},
        *({"type": "response.output_text.delta", **where, "delta": piece, "logprobs": []} for piece in TEXT),
        {"type": "response.output_text.done", **where, "text": "".join(TEXT), "logprobs": []},
        {"type": "response.content_part.done", **where, "part": {**part, "text": "".join(TEXT)}},
        {"type": "response.output_item.done", "output_index": 0, "item": done_item},
        {"type": "response.completed", "response": _response(response_id, body, "completed", padding)},
    ]


class ResponsesStub:
    """Both legs of a Responses call on one loopback server; ``stored``: the ids it answered."""

    def __init__(self, *, padding: int = 0) -> None:
        self.padding = padding
        self.stored: list[str] = []
        self.decode_bodies: list[dict[str, Any]] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._server.daemon_threads = True
        self._server.stub = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def __enter__(self) -> ResponsesStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        stub: ResponsesStub = self.server.stub  # type: ignore[attr-defined]
        body = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)))
        if self.path.rstrip("/") != "/v1/responses":
            self._json(404, {"error": {"message": f"no route {self.path}", "type": "stub_error", "code": 404}})
            return
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            answer = _response("resp_prefill", body, "completed", 0)
            answer["usage"] |= PREFILL_USAGE
            answer["kv_transfer_params"] = {**NIXL_PARAMS, "prompt_token_ids": list(range(1, 8))}
            self._json(200, answer)
            return
        previous = body.get("previous_response_id")
        if previous is not None and previous not in stub.stored:
            message = f"Response with id '{previous}' not found."
            self._json(404, {"error": {"message": message, "type": "invalid_request_error", "code": 404}})
            return
        stub.decode_bodies.append(body)
        response_id = f"resp_{len(stub.stored):032x}"
        stub.stored.append(response_id)
        if not body.get("stream"):
            self._json(200, _response(response_id, body, "completed", stub.padding))
            return
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        data = b"".join(
            f"event: {event['type']}\ndata: {json.dumps({**event, 'sequence_number': n})}\n\n".encode()
            for n, event in enumerate(events(response_id, body, stub.padding))
        )
        try:
            for start in range(0, len(data), WRITE):
                piece = data[start : start + WRITE]
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                time.sleep(PAUSE)
            self.wfile.write(b"0\r\n\r\n")
        except OSError:
            self.close_connection = True  # the client left (pdclient cut a stream it refused)

    def _json(self, status: int, payload: Any) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
