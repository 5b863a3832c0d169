"""Guard for the ``kv_transfer_params`` channel: an HMAC check before vLLM sees the request.

Seam note
---------
Why: any client that can reach a vLLM server may send ``kv_transfer_params``: forward
  ``prompt_token_ids`` that do not match its messages (skipping the server's chat
  template and system prompt), or point the KV connector at an arbitrary
  ``remote_host``. vLLM does not check who sent them. With ``PDCLIENT_REUSE_SECRET`` set,
  every request whose JSON body carries ``kv_transfer_params`` must carry a valid
  signature of them (spec: ``_signing.py``), or it gets HTTP 403 before vLLM parses,
  renders or schedules anything - in particular before vLLM 0.32's rejection cleanup,
  which would hand the unverified params to the KV connector.
Upstream: none; vLLM has ``--api-key`` for the whole server, not per-field provenance.
When to remove: when vLLM authenticates ``kv_transfer_params`` itself, or when every
  route to your decode servers is trusted.

Where: an ASGI middleware around vLLM's FastAPI app. vLLM has built that app in a
different module in nearly every release (and ``python -m`` runs it as ``__main__``), so
the hook is Starlette's ``build_middleware_stack``, which FastAPI calls once, lazily, on
the app's first ASGI call - after vLLM added all its own middleware. The guard is the
outermost layer. It buffers each POST body (vLLM reads them whole anyway) and parses only
those that could name ``kv_transfer_params``.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from . import _verify
from ._signing import SIGNATURE_KEY, verified_canonical_bytes

logger = logging.getLogger("vllm.plugins.pdclient_reuse")

# Bodies that cannot name kv_transfer_params skip the JSON parse. A key can also be
# spelled with \u escapes ("kv\u005ftransfer_params"), so any escape means: parse.
_NEEDLES = (b"kv_transfer_params", b"\\u")


class PDClientMiddleware:
    """Pure ASGI middleware: records X-Request-Id for logs; enforces signatures if a secret is set."""

    def __init__(self, app: Any, secret: str | None) -> None:
        self.app = app
        self.secret = secret

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        # A FastAPI app mounted inside another gets its own stack: guard once.
        if scope["type"] != "http" or scope.get("pdclient.seen"):
            return await self.app(scope, receive, send)
        scope = dict(scope, **{"pdclient.seen": True})
        request_id = _header(scope, b"x-request-id")
        token = _verify.REQUEST_ID.set(request_id.decode("latin-1") if request_id else None)
        try:
            # Every POST, whatever its content-type: some vLLM routes (e.g. SageMaker's
            # /invocations) parse the raw body as JSON themselves.
            if self.secret is None or scope["method"] != "POST":
                return await self.app(scope, receive, send)
            await self._guarded(scope, receive, send)
        finally:
            _verify.REQUEST_ID.reset(token)

    async def _guarded(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        body, disconnected = await _read_body(receive)
        if disconnected:
            return
        if any(needle in body for needle in _NEEDLES):
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None  # not JSON: vLLM answers 400 itself
            kv = payload.get("kv_transfer_params") if isinstance(payload, dict) else None
            if kv is not None:
                canonical = verified_canonical_bytes(kv, self.secret) if isinstance(kv, dict) else None  # type: ignore[arg-type]
                if canonical is None:
                    return await _forbidden(send, kv)
                # vLLM must not see the signature (it would travel on to the KV connector).
                # The canonical bytes are exactly the params without it: reuse them
                # rather than serializing the id list a second time.
                del payload["kv_transfer_params"]
                head = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")[:-1]
                body = head + (b"," if payload else b"") + b'"kv_transfer_params":' + canonical + b"}"
                scope = dict(scope, headers=_with_content_length(scope["headers"], len(body)))
        await self.app(scope, _replay(body, receive), send)


async def _read_body(receive: Any) -> tuple[bytes, bool]:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False


def _replay(body: bytes, receive: Any) -> Any:
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # later calls: wait for the disconnect, as the server would

    return replay


async def _forbidden(send: Any, kv: Any) -> None:
    _verify.metrics()["rejected"].inc()
    reason = "missing" if not (isinstance(kv, dict) and SIGNATURE_KEY in kv) else "invalid"
    request_id = _verify.REQUEST_ID.get()
    logger.warning(
        "pdclient_reuse: 403 for a request with %s kv_transfer_params.%s%s",
        reason,
        SIGNATURE_KEY,
        f" (X-Request-Id {request_id})" if request_id else "",
    )
    # The shape of vLLM's own ErrorResponse, so OpenAI clients raise PermissionDeniedError.
    body = json.dumps(
        {
            "error": {
                "message": f"kv_transfer_params must be signed: {reason} kv_transfer_params.{SIGNATURE_KEY}",
                "type": "PermissionDenied",
                "param": f"kv_transfer_params.{SIGNATURE_KEY}",
                "code": 403,
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 403,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


def _with_content_length(headers: Any, length: int) -> list[tuple[bytes, bytes]]:
    kept = [(k, v) for k, v in headers if k.lower() != b"content-length"]
    return [*kept, (b"content-length", str(length).encode())]


def install(secret: str | None) -> bool:
    """Wrap ``FastAPI.build_middleware_stack`` so each app gets the middleware outermost."""
    from fastapi import FastAPI

    original = FastAPI.build_middleware_stack
    if getattr(original, "__pdclient_wrapped__", False):
        return True

    def build_middleware_stack(self: Any) -> Any:
        # Created here, in the process that serves HTTP, after vLLM set up prometheus.
        _verify.metrics()
        return PDClientMiddleware(original(self), secret)

    build_middleware_stack.__pdclient_wrapped__ = True  # type: ignore[attr-defined]
    build_middleware_stack.__wrapped__ = original  # type: ignore[attr-defined]
    FastAPI.build_middleware_stack = build_middleware_stack  # type: ignore[method-assign]
    return True
