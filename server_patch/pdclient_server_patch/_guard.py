"""Guard for the ``kv_transfer_params`` channel: a request signature checked before vLLM sees the request.

Seam note
---------
Why: any client that can reach a vLLM server may send ``kv_transfer_params``: forward
  ``prompt_token_ids`` that do not match its messages (skipping the server's chat
  template and system prompt), or point the KV connector at an arbitrary
  ``remote_host``. vLLM does not check who sent them. With ``PDCLIENT_REUSE_SECRET`` set,
  a POST whose body is not validly signed (``X-PDClient-Signature``, spec v2 in
  ``wire/_signing.py``: an HMAC of method, path, expiry, nonce and the exact body) must not
  carry ``kv_transfer_params`` anywhere vLLM reads them, or it gets HTTP 403 before vLLM
  parses, renders or schedules anything - in particular before vLLM 0.32's rejection
  cleanup, which would hand unverified params to the KV connector.
Upstream: none; vLLM has ``--api-key`` for the whole server, not per-field provenance.
When to remove: when vLLM authenticates ``kv_transfer_params`` itself, or when every
  route to your decode servers is trusted.

Where: an ASGI middleware around vLLM's FastAPI app. vLLM has built that app in a
different module in nearly every release (and ``python -m`` runs it as ``__main__``), so
the hook is Starlette's ``build_middleware_stack``, which FastAPI calls once, lazily, on
the app's first ASGI call - after vLLM added all its own middleware. The guard is the
outermost layer. It buffers each POST body (vLLM reads them whole anyway) and passes it
on byte for byte.

What an unsigned body may not hold: an object key ``kv_transfer_params`` with a non-null
value at any depth (top level for chat, completions, responses...;
``sampling_params.extra_args`` on ``/inference/v1/generate``; ``vllm_xargs``...), read the
way vLLM's routes read bodies: ``json.loads(bytes)``, which detects UTF-8/16/32 by itself
and decodes ``\\u`` escapes in keys. A UTF-8 body holding neither the key's bytes nor a
``\\u`` escape of an ASCII character (the only other way to spell the key) passes
without a parse; a body that could hold the key but cannot be decoded or parsed is
refused. A validly signed body passes without any parse. Nothing in here answers 500:
any failure is a 4xx naming what was wrong.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from . import _verify
from ._signing import DEFAULT_MAX_AGE, SIGNATURE_HEADER, SignatureError, verify

logger = logging.getLogger("vllm.plugins.pdclient_reuse")

KEY = "kv_transfer_params"
_KEY_BYTES = KEY.encode("ascii")
# A \u escape of a character in 0x00-0x7f: the only way besides the plain bytes to
# spell the key (escapes of non-ASCII text, which encoders emit, cannot form it).
_ASCII_ESCAPE = re.compile(r"\\u00[0-7][0-9a-fA-F]")
_ASCII_ESCAPE_BYTES = re.compile(_ASCII_ESCAPE.pattern.encode("ascii"))
_HEADER_BYTES = SIGNATURE_HEADER.encode("ascii")

MAX_NONCES = 200_000
"""Accepted nonces remembered at once per process (~25 MB at most); beyond, signatures are refused."""


class NonceMemory:
    """Nonces of accepted signatures, each remembered until its expiry ``t``; one per process.

    Keyed by ``(t, nonce)``: a replay repeats both (any other ``t`` needs a new HMAC).
    Expired buckets are dropped as time passes, so the memory holds at most the nonces
    of the last ``max_age`` seconds; past ``limit`` it refuses rather than forgets.
    """

    def __init__(self, limit: int = MAX_NONCES) -> None:
        self.limit = limit
        self._by_expiry: dict[int, set[str]] = {}
        self._count = 0
        self._earliest = float("inf")

    def __len__(self) -> int:
        return self._count

    def accept(self, t: int, nonce: str, now: float) -> str | None:
        """Remember ``nonce``; None if it is fresh, else why the signature is refused."""
        if now > self._earliest:
            self._forget(now)
        bucket = self._by_expiry.get(t)
        if bucket is not None and nonce in bucket:
            return "nonce already used (a replayed request)"
        if self._count >= self.limit:
            return f"replay memory full ({self.limit} signed requests within max_age): try again later"
        if bucket is None:
            bucket = self._by_expiry[t] = set()
            self._earliest = min(self._earliest, t)
        bucket.add(nonce)
        self._count += 1
        return None

    def _forget(self, now: float) -> None:
        for t in [t for t in self._by_expiry if t < now]:
            self._count -= len(self._by_expiry.pop(t))
        self._earliest = min(self._by_expiry, default=float("inf"))


class PDClientMiddleware:
    """Pure ASGI middleware: records X-Request-Id for logs; enforces signatures if a secret is set."""

    def __init__(
        self, app: Any, secret: str | None, max_age: float = DEFAULT_MAX_AGE, nonces: NonceMemory | None = None
    ) -> None:
        self.app = app
        self.secret = secret
        self.max_age = max_age
        self.nonces = nonces if nonces is not None else NonceMemory()

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
        try:
            refusal = self.refusal(scope, body)
        except Exception as exc:  # never a 500 from the guard
            logger.exception("pdclient_reuse: guard failed on a request")
            refusal = (400, f"the pdclient guard could not check this request ({type(exc).__name__}: {exc})")
        if refusal is not None:
            return await _refuse(send, *refusal)
        await self.app(scope, _replay(body, receive), send)

    def refusal(self, scope: dict[str, Any], body: bytes) -> tuple[int, str] | None:
        """None when the request may go on to vLLM, else (status, why)."""
        assert self.secret is not None
        values = [v for k, v in scope.get("headers", ()) if k.lower() == _HEADER_BYTES]
        if not values:
            unsigned = f"no {SIGNATURE_HEADER} header"
        elif len(values) > 1:
            unsigned = f"{len(values)} {SIGNATURE_HEADER} headers"
        else:
            now = time.time()
            try:
                t, nonce = verify(
                    self.secret,
                    scope["method"],
                    _paths(scope),
                    body,
                    bytes(values[0]).decode("latin-1"),
                    now=now,
                    max_age=self.max_age,
                )
            except SignatureError as why:
                unsigned = str(why)
            else:
                replay = self.nonces.accept(t, nonce, now)
                if replay is None:
                    return None  # validly signed: passes without any parse
                unsigned = replay
        carried = carried_kv_params(body)
        if carried is None:
            return None
        return 403, f"{carried} needs a valid X-PDClient-Signature header ({unsigned})"


def carried_kv_params(body: bytes) -> str | None:
    """None when ``body`` cannot carry a non-null ``kv_transfer_params`` as vLLM reads it, else what it carries."""
    encoding = json.detect_encoding(body)  # what json.loads(bytes) does
    # The common case, no parse. (find(b"\\") is a memchr; `b"\\u" in body` would cost
    # more than the regex it is meant to spare.)
    if (
        encoding == "utf-8"
        and _KEY_BYTES not in body
        and (body.find(b"\\") < 0 or not _ASCII_ESCAPE_BYTES.search(body))
    ):
        return None
    try:
        text = body.decode(encoding, "surrogatepass")
    except UnicodeDecodeError as exc:
        return f"a body that is not valid {encoding} (so cannot be checked for {KEY}: {exc.reason})"
    if encoding != "utf-8" and KEY not in text and not _ASCII_ESCAPE.search(text):
        return None
    found: list[str] = []

    def pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        # Every pair, so a duplicate key cannot hide one value behind another.
        found.extend(type(value).__name__ for key, value in pairs if key == KEY and value is not None)
        return dict(pairs)

    try:
        json.loads(text, object_pairs_hook=pairs_hook)
    except (ValueError, RecursionError) as exc:
        return f"a body that may name {KEY} but is not JSON ({type(exc).__name__}: {str(exc)[:200]})"
    if not found:
        return None
    return KEY if encoding == "utf-8" else f"{KEY} in a {encoding} body"


def _paths(scope: dict[str, Any]) -> tuple[str, ...]:
    """The request's path as the client may have signed it (see the spec on root_path)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "") or ""
    if not root:
        return (path,)
    if path.startswith(root + "/"):
        return (path, path[len(root) :])
    return (path, root + path)


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


async def _refuse(send: Any, status: int, why: str) -> None:
    _verify.metrics()["rejected"].inc()
    request_id = _verify.REQUEST_ID.get()
    logger.warning(
        "pdclient_reuse: %d for a request: %s%s", status, why, f" (X-Request-Id {request_id})" if request_id else ""
    )
    # The shape of vLLM's own ErrorResponse, so OpenAI clients raise PermissionDeniedError.
    body = json.dumps(
        {
            "error": {
                "message": f"pdclient guard: {why}",
                "type": "PermissionDenied" if status == 403 else "BadRequest",
                "param": KEY,
                "code": status,
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _header(scope: dict[str, Any], name: bytes) -> bytes | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return bytes(value)
    return None


NONCES = NonceMemory()
"""This process's memory of accepted nonces, shared by every app the guard wraps."""


def install(secret: str | None, max_age: float = DEFAULT_MAX_AGE) -> bool:
    """Wrap ``FastAPI.build_middleware_stack`` so each app gets the middleware outermost."""
    from fastapi import FastAPI

    original = FastAPI.build_middleware_stack
    if getattr(original, "__pdclient_wrapped__", False):
        return True

    def build_middleware_stack(self: Any) -> Any:
        # Created here, in the process that serves HTTP, after vLLM set up prometheus.
        _verify.metrics()
        return PDClientMiddleware(original(self), secret, max_age, NONCES)

    build_middleware_stack.__pdclient_wrapped__ = True  # type: ignore[attr-defined]
    build_middleware_stack.__wrapped__ = original  # type: ignore[attr-defined]
    FastAPI.build_middleware_stack = build_middleware_stack  # type: ignore[method-assign]
    return True
