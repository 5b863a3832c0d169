"""Per-call facts of a P/D handoff, carried back as response headers and to ``on_trace``."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

logger = logging.getLogger("pdclient")

HEADER_PREFIX = "x-pd-"


class PDTrace(BaseModel):
    """What one chat or completions call did.

    ``fallback`` is None when the handoff went as planned; otherwise it says how it
    degraded (for example ``"ids not forwarded: media"`` or ``"prefill failed: ..."``).
    Times are milliseconds measured on the client.
    """

    model_config = ConfigDict(frozen=True)

    request_id: str
    route: str
    """``chat``, ``completions`` or ``passthrough`` (any other request, sent to decode)."""
    prefill_url: str | None = None
    decode_url: str | None = None
    prefill_ms: float | None = None
    decode_headers_ms: float | None = None
    """From sending the decode request to its response status and headers."""
    decode_first_byte_ms: float | None = None
    """From sending the decode request to the first byte of its body."""
    forwarded_tokens: int = 0
    handoff_cpu_ms: float | None = None
    """Client CPU time spent reading the prefill result and building the decode body."""
    fallback: str | None = None

    def to_headers(self) -> dict[str, str]:
        """The fields known when the decode response starts, as ``x-pd-*`` headers."""
        headers: dict[str, str] = {}
        for name, value in self.model_dump(exclude={"decode_first_byte_ms"}).items():
            if value is not None:
                headers[HEADER_PREFIX + name.replace("_", "-")] = _format(value)
        return headers

    @classmethod
    def from_headers(cls, headers: Mapping[str, str]) -> PDTrace:
        """Rebuild a trace from a raw response's headers (``with_raw_response``)."""
        fields: dict[str, Any] = {}
        for name in cls.model_fields:
            value = headers.get(HEADER_PREFIX + name.replace("_", "-"))
            if value is not None:
                fields[name] = value
        return cls.model_validate(fields)


def _format(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    # Header values must be latin-1; a reason may quote a server's message.
    return str(value).encode("latin-1", "replace").decode("latin-1").replace("\n", " ")


TraceCallback = Callable[[PDTrace], None]


def deliver(trace: PDTrace, callback: TraceCallback | None) -> None:
    """Hand a finished trace to the caller's callback; its failure never fails the call."""
    if trace.fallback is not None:
        logger.warning("P/D handoff %s degraded: %s", trace.request_id, trace.fallback)
    else:
        logger.debug("P/D handoff %s: %s", trace.request_id, trace)
    if callback is None:
        return
    try:
        callback(trace)
    except Exception:
        logger.exception("on_trace callback raised for request %s", trace.request_id)
