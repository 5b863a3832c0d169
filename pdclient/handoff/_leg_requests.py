"""The requests of a call's legs: the caller's request on another base, filtered and signed.

A leg's request is the caller's method, path, query and headers on the leg's endpoint,
with the hop-by-hop headers left out and the call's leg id set (both legs carry the same
one, ``new_leg_id``; the caller's own ``x-request-id`` never reaches a server). A body
pdclient built is signed for servers whose server patch guards ``kv_transfer_params``
(``wire.signature``), so a forged or replayed id array is refused.
The bodies come from the call's dialect; this module only chooses which one a leg sends
(``decode_body``: armed for migration, asking for the usage the memory learns from).
"""

from __future__ import annotations

import functools
import secrets
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx

from .. import wire
from .. import wire as usage
from .._options import PDOptions, call_override_refusal
from ..dialects import Dialect, dialect_for, untag_path
from ..fleet import WARM_UP_TIMEOUT, Fetch
from ..migration import CallMigration
from ..pools import Endpoint, EndpointPool
from ..wire import CALL_OPTIONS_KEY, HOP_BY_HOP, PREFILL_FAILURE_POLICIES, SIGNATURE_HEADER, CallOptions, signature

# Hop-by-hop or derived headers that must not be copied onto a leg's new request (the
# request id is set anew, as the call's leg id).
_DROPPED_REQUEST_HEADERS = HOP_BY_HOP | {b"host", b"content-length", b"x-request-id"}
# How the caller framed its body: kept when its body stream goes on unread (a leg without
# them would declare no body, and h11 refuses to send one).
_BODY_FRAMING = frozenset({b"content-length", b"transfer-encoding"})
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})  # httpx declares even an empty one


def new_leg_id() -> str:
    """The id a call's legs carry: 128 random bits, anew per call.

    vLLM's push mode pairs a decode's registration with the prefill's blocks by it, so no
    caller may choose or predict it: never a caller's ``x-request-id`` (that stays a
    correlation id), nor a counter after a prefix a caller can read off its answers."""
    return f"pd-{secrets.token_hex(16)}"


def new_correlation_id() -> str:
    """A correlation id for a caller that gave none: random too, and never the legs' id."""
    return f"req-{secrets.token_hex(16)}"


def caller_target(request: httpx.Request, decode: EndpointPool) -> tuple[str, Dialect | None, str | None]:
    """What the caller's request asks of the decode pool its URL lies under: its path below
    the pool's base ("" outside the pool), the API a P/D call speaks there (None: a
    pass-through), and the decode endpoint's tag a pass-through's stored response carries
    (stripped from the path: the leg goes to the endpoint it names)."""
    url = str(request.url).partition("?")[0]  # copy_with(query=None) would parse the URL again
    base = decode.base_of(url)
    if base is None:
        return "", None, None
    path = url[len(base) :]
    dialect = dialect_for(path) if request.method == "POST" else None
    if dialect is not None:
        return path, dialect, None
    untagged, tag = untag_path(path)
    return untagged, None, tag


@functools.lru_cache(maxsize=1024)
def leg_url(base: str, path: str, query: bytes) -> httpx.URL:
    """A leg's URL, parsed once per endpoint, path and query (httpx URLs are immutable)."""
    return httpx.URL(base + path, query=query or None)


def request_with_content(
    method: str, url: httpx.URL, headers: list[tuple[bytes, bytes]], content: bytes, extensions: dict[str, Any]
) -> httpx.Request:
    """A request whose body is known, as ``httpx.Request(content=...)`` builds it.

    Given the body as a stream, httpx takes the headers as they are: ``content=`` would
    scan them again for each header it might add (~0.1 ms a request in ``pdclient
    serve``). So ``headers`` are complete but for the length, added here as httpx adds it.
    """
    if content or method in _METHODS_WITH_BODY:
        headers = [*headers, (b"content-length", str(len(content)).encode("ascii"))]
    request = httpx.Request(method, url, headers=headers, stream=httpx.ByteStream(content), extensions=extensions)
    request.read()  # ``request.content`` is there to read, as with ``content=``
    return request


def streams_upload(request: httpx.Request) -> bool:
    """A multipart upload not read yet: it goes on unread, scanned as it passes
    (``wire.UploadScan``). Any other body is read and checked before it is sent."""
    if wire.media_type(request.headers.get("content-type")) != wire.MULTIPART:
        return False
    try:
        request.content  # noqa: B018 (whether it was read: a server passing bodies on reads them)
    except httpx.RequestNotRead:
        return True
    return False


def pass_through_body(request: httpx.Request) -> bytes | None:
    """A pass-through request's body, read, as it goes on: a JSON body without pdclient's
    per-call options, None for any other (the caller's stream is forwarded). Raises
    ``wire.Refusal`` for a body that could carry a ``kv_transfer_params`` pdclient did not
    write, or misspelt per-call options."""
    headers = request.headers
    wire.check_forwarded_body(request.content, headers.get("content-type"), headers.get("content-encoding"))
    if wire.media_type(headers.get("content-type")) == "application/json":
        return wire.without_call_options(request.content)
    return None


def call_options_refusal(given: CallOptions, options: PDOptions) -> str | None:
    """Why a P/D call's per-call options are refused here, or None: a fallback URL the client
    does not allow, or an option it does not let a call override."""
    policy = given.on_prefill_failure
    if policy not in (None, *PREFILL_FAILURE_POLICIES) and not options.allow_call_fallback_url:
        return (
            f"{CALL_OPTIONS_KEY}.on_prefill_failure may be {' or '.join(PREFILL_FAILURE_POLICIES)} here, "
            "not a fallback URL (allow_call_fallback_url is off)"
        )
    return call_override_refusal(given, options)


class LegRequests:
    """The requests of one call's legs, on whichever base each attempt goes to."""

    __slots__ = ("_leg_id", "_path", "_request", "_secret")

    def __init__(self, request: httpx.Request, leg_id: str, relative_path: str, secret: str | None) -> None:
        self._request = request
        self._leg_id = leg_id
        self._path = relative_path
        self._secret = secret

    def sign(self, base: str, content: bytes) -> str | None:
        """The leg's signature for servers whose server patch guards kv_transfer_params, if a
        secret is set (a fresh nonce each time: one per attempt)."""
        if not self._secret:
            return None
        return signature(self._secret, self._request.method, httpx.URL(base + self._path).path, content)

    def signed(self, base: str, content: bytes, deadline: float | None = None) -> httpx.Request:
        """A leg's request on ``base`` with a body pdclient built, signed if a secret is set."""
        return self.build(base, content, self.sign(base, content), deadline)

    def build(
        self, base: str, content: bytes | None, signed_with: str | None = None, deadline: float | None = None
    ) -> httpx.Request:
        """A leg's request: the caller's method, path, query and headers, on ``base``.

        ``content`` None forwards the caller's body stream as it is (pass-through: a
        multipart upload is never read into memory here).
        """
        caller = self._request
        url = caller.url
        if self._path:
            url = leg_url(base, self._path, url.query)
        # One pass over the caller's raw headers: httpx's Headers.pop scans them per name.
        raw = caller.headers.raw
        headers = [(k, v) for k, v in raw if k.lower() not in _DROPPED_REQUEST_HEADERS]
        headers += [(b"x-request-id", self._leg_id.encode("ascii")), (b"host", url.netloc)]
        if signed_with is not None:
            headers.append((SIGNATURE_HEADER.encode("ascii"), signed_with.encode("ascii")))
        extensions = _timeout_within(caller.extensions, deadline)
        if content is None:
            headers += [(k, v) for k, v in raw if k.lower() in _BODY_FRAMING]
            stream = _ScannedUpload(caller.stream) if streams_upload(caller) else caller.stream
            return httpx.Request(caller.method, url, headers=headers, stream=stream, extensions=extensions)
        return request_with_content(caller.method, url, headers, content, extensions)

    def warm_up(self, endpoint: Endpoint, content: bytes) -> Fetch:
        """A decode-only call's prompt as a plain one-token call to a prefill endpoint
        (``fleet._warm``): unsigned (no ``kv_transfer_params``), under an id of its own."""
        request = self.build(endpoint.url, content)
        request.headers["x-request-id"] = f"{self._leg_id}-warm-up"
        headers = tuple((k, v) for k, v in request.headers.multi_items() if k != "host")
        return Fetch(str(request.url), WARM_UP_TIMEOUT, endpoint.host_name, request.content, headers)


def decode_body(
    dialect: Dialect,
    plan: wire.Plan,
    prefill: wire.PrefillResult | None,
    migration: CallMigration,
    *,
    asks_usage: bool = False,
) -> bytes:
    """The decode body for ``prefill``'s KV (None: decode-only, or the prefill failed): the one
    a stream that may move sends (what its continuation needs) when ``migration`` is armed,
    else the dialect's; ``asks_usage`` adds the usage event the caller did not ask for."""
    body = migration.decode_body(plan, prefill) if migration.armed else dialect.decode_body(plan, prefill)
    return usage.with_usage_asked(body) if asks_usage else body


def asks_usage(plan: wire.Plan, *, collecting: bool, decode_only: bool) -> bool:
    """Whether a decode-only chat stream asks its server for the usage the caller did not:
    the prompt's length and cache hits, the truth the conversation estimates learn from.
    A caller that turned usage off (``include_usage: false``) is asked for all the same, and
    sees none: without it the turn's prompt length is unknown, and the next turn's estimate
    falls back to what the turn before it left cached."""
    return (
        collecting
        and decode_only
        and plan.kind is wire.Kind.CHAT  # the other APIs' streams report usage on their own
        and plan.stream
        and not _usage_asked_by_caller(plan)
    )


def _usage_asked_by_caller(plan: wire.Plan) -> bool:
    if "stream_options" not in plan.fields:
        return False
    try:
        options = wire.field_value(plan.fields, "stream_options")
    except wire.Refusal:
        return True  # options pdclient cannot read go to the server as they are
    return isinstance(options, dict) and options.get("include_usage") is True


class _ScannedUpload(httpx.SyncByteStream, httpx.AsyncByteStream):
    """A multipart upload on its way to the server, unread: each chunk is scanned
    (``wire.UploadScan``) before it is sent, so a refused one never reaches the server
    whole (its form is never parsed) and the transport answers the ``Refusal`` with a 400.
    Iterated again (a retry), it scans the caller's stream again from its start."""

    def __init__(self, stream: httpx.SyncByteStream | httpx.AsyncByteStream) -> None:
        self._stream = stream

    def __iter__(self) -> Iterator[bytes]:
        scan = wire.UploadScan()
        for chunk in self._stream:  # type: ignore[union-attr]
            scan.feed(chunk)
            yield chunk

    async def __aiter__(self) -> AsyncIterator[bytes]:
        scan = wire.UploadScan()
        async for chunk in self._stream:  # type: ignore[union-attr]
            scan.feed(chunk)
            yield chunk

    def close(self) -> None:
        if isinstance(self._stream, httpx.SyncByteStream):
            self._stream.close()

    async def aclose(self) -> None:
        if isinstance(self._stream, httpx.AsyncByteStream):
            await self._stream.aclose()


def _timeout_within(extensions: dict[str, Any], deadline: float | None) -> dict[str, Any]:
    """A copy of request extensions whose timeouts end no later than ``deadline`` (None: unchanged)."""
    if deadline is None:
        return dict(extensions)
    remaining = max(0.001, deadline - time.monotonic())
    timeouts = extensions.get("timeout") or {}
    clipped = {k: remaining if v is None else min(v, remaining) for k, v in timeouts.items()}
    return {**extensions, "timeout": clipped}
