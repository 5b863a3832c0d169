"""The headers pdclient never passes on, and the prefix of those it writes, named once.

Lower-case bytes, as ASGI and httpx's raw header lists hold names.
"""

from __future__ import annotations

HOP_BY_HOP = frozenset(
    {b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"proxy-connection", b"te",
     b"trailer", b"transfer-encoding", b"upgrade"}
)  # fmt: skip
"""Headers that describe one connection, not the message (RFC 9110 section 7.6.1, and the
common proxy-connection): every hop sets its own, so none is copied from one to the next."""

TRACE_HEADER_PREFIX = "x-pd-"
"""pdclient's own response headers (``PDTrace.to_headers``): a server's are never passed on as such."""
RAW_TRACE_HEADER_PREFIX = TRACE_HEADER_PREFIX.encode("ascii")
FAILED_LEG_HEADER = TRACE_HEADER_PREFIX + "failed-leg"
"""Which leg failed, on an error pdclient answers: the one trace header a caller always gets."""
TRACE_HEADERS_EXTENSION = "pdclient.trace_headers"
"""The httpx request extension by which a server passing its callers' requests on (``pdclient
serve``) declines the trace headers of a handed-off call's answer: set to False, an answer
carries none (one whose decode failed still does, ``FAILED_LEG_HEADER`` among them). Building
them, only for that server to drop them, was ~9 % of its own CPU per call (in process).
Never read from anything a caller sends."""
