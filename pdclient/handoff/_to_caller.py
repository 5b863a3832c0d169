"""What goes back to the caller: its response's headers, and the decode body's bytes on their way.

The decode body passes through up to four steps, each chosen once, when the decode's
response arrives (``CallerBody.begin``): the usage merge of a disaggregated call
(the prompt side is the prefill's, as vllm-router reports it), the decode endpoint's tag
in a Responses answer's ids, and the usage event pdclient asked for itself taken out
again. The conversation memory's answer collector is handed the decode's bytes as they
come, and reads them itself, in batches, off the per-event path.
"""

from __future__ import annotations

from collections.abc import Collection

import httpx

from .. import wire
from .. import wire as usage
from .._trace import Outcome
from ..conversations import AnswerCollector
from ..dialects import Dialect, IdTags, endpoint_tag
from ..wire import RAW_TRACE_HEADER_PREFIX, USAGE_KEY, SSEFramer, event_json, pass_events

CONTENT_LENGTH = frozenset({b"content-length"})
READ_BODY_FRAMING = frozenset({b"content-length", b"content-encoding", b"transfer-encoding"})
"""How a server framed a body pdclient read whole (so decoded): set anew for the caller."""


def usage_merge_for(
    dialect: Dialect | None, outcome: Outcome, prefill: wire.PrefillResult | None, status: int, content_type: str
) -> usage.UsageMerge | None:
    """How the decode body's ``usage`` is merged on its way to the caller, if it is.

    A disaggregated call's prompt side (``prompt_tokens``, ``prompt_tokens_details``:
    the cached tokens) is the prefill's, as vllm-router reports it; the completion side
    is the decode's. A decode-only or fallback call's usage is the decode's, unchanged.
    """
    if outcome is not Outcome.DISAGGREGATED or prefill is None or dialect is None or status != 200:
        return None
    return dialect.usage_merge(prefill, content_type)


def id_tags_for(
    tags_answer_ids: bool, endpoint_url: str | None, status: int, content_type: str, secret: str | None
) -> IdTags | None:
    """How a Responses answer from a pool's decode endpoint gets that endpoint's tag (keyed
    with ``secret``, ``PDOptions.reuse_secret``) in its ids."""
    if not tags_answer_ids or endpoint_url is None or status != 200:
        return None
    if content_type.startswith("text/event-stream"):
        return IdTags(endpoint_tag(endpoint_url, secret), stream=True)
    if content_type.startswith("application/json"):
        return IdTags(endpoint_tag(endpoint_url, secret), stream=False)
    return None


class CallerBody:
    """The decode body's bytes on their way to the caller (the streams pass every chunk through
    ``feed`` and end with ``rest``): the usage merged, the ids tagged, the answer collected,
    the asked usage stripped.

    An event stream is framed once, here (``wire.SSEFramer``), when a step rewrites events,
    and each whole event's data parsed at most once (``wire.event_json``) for every step
    that reads it; a JSON body goes through each step's own hold-until-whole. The answer
    collector gets the decode's bytes unchanged (``AnswerCollector.feed``).
    """

    __slots__ = ("_framer", "_usage_only", "collector", "merge", "stream", "strip", "tags")

    def __init__(self) -> None:
        self.merge: usage.UsageMerge | None = None
        self.tags: IdTags | None = None
        self.collector: AnswerCollector | None = None
        self.strip: usage.UsageStrip | None = None
        self.stream = False
        self._framer: SSEFramer | None = None
        self._usage_only = False

    def begin(
        self, content_type: str, merge: usage.UsageMerge | None, tags: IdTags | None, strip: usage.UsageStrip | None
    ) -> None:
        """The steps for the decode response's body, chosen before the caller reads a byte."""
        self.merge, self.tags, self.strip = merge, tags, strip
        self.stream = content_type.startswith("text/event-stream")
        steps = (merge, tags, strip)
        self._framer = SSEFramer() if self.stream and any(step is not None for step in steps) else None
        # The merge and the strip read the usage event alone; the tags every event.
        self._usage_only = tags is None

    @property
    def recounted(self) -> bool:
        """Whether a JSON body's length changes on the way (the merged usage, the tagged ids)."""
        return any(step is not None and not step.stream for step in (self.merge, self.tags))

    def feed(self, data: bytes) -> bytes:
        """What goes on now (a partial SSE event waits for its end, a JSON body until it is whole)."""
        if self.collector is not None:
            self.collector.feed(data)  # the decode's own bytes: its usage, not the merged one
        return self._through_steps(data)

    def _through_steps(self, data: bytes) -> bytes:
        framer = self._framer
        if framer is not None:
            if self._usage_only and USAGE_KEY not in data and framer.whole(data):
                return data  # whole events, none a usage: most reads of a stream, a token each
            return pass_events(framer, data, self._event)
        if self.stream:
            return data  # no step reads the stream: passed on as it comes
        if self.merge is not None:
            data = self.merge.feed(data)
        if self.tags is not None:
            data = self.tags.feed(data)
        return data

    def events(self, events: list[bytes]) -> bytes:
        """Whole events framed already (a tracked stream's, ``migration.Tracker``): through
        every step without being framed again, nor parsed again where the tracker parsed
        one (``wire.ParsedEvent``)."""
        if self.collector is not None:
            self.collector.feed_events(events)
        if self._framer is None:
            return self._through_steps(b"".join(events))
        return b"".join([self._event(event) for event in events])

    def rest(self) -> bytes:
        """What the steps still hold, once the decode body is whole."""
        if self._framer is not None:
            rest = self._framer.rest()
            return self._event(rest) if rest else b""
        if self.stream:
            return b""
        rest = self.merge.end() if self.merge is not None else b""
        if self.tags is not None:
            rest = self.tags.feed(rest) + self.tags.end()
        return rest

    def _event(self, raw: bytes) -> bytes:
        """One whole event through every step, its data parsed once if a step reads it."""
        reads = USAGE_KEY in raw and (self.merge is not None or self.strip is not None)
        payload = event_json(raw) if reads else None
        if self.merge is not None:
            raw = self.merge.event(raw, payload)
        if self.tags is not None:
            raw = self.tags.event(raw)
        if self.strip is not None:
            raw = self.strip.event(raw, payload)
        return raw


def without_trace_headers(headers: httpx.Headers, dropped: Collection[bytes] = ()) -> list[tuple[bytes, bytes]]:
    """A server's response headers without any ``x-pd-*`` of its own (only pdclient writes
    those) nor those ``dropped`` (lower-case names), to which the trace's are added."""
    # As raw bytes: a value beyond ASCII passes as it came (as str, httpx would encode it as
    # ASCII), and one pass over the list (httpx's Headers.update and pop scan it per name).
    return [
        (k, v)
        for k, v in headers.raw
        if not (name := k.lower()).startswith(RAW_TRACE_HEADER_PREFIX) and name not in dropped
    ]


def raw_headers(trace_headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    """``PDTrace.to_headers()`` (ASCII by construction) as raw header pairs."""
    return [(k.encode("ascii"), v.encode("ascii")) for k, v in trace_headers.items()]


def caller_response(
    response: httpx.Response,
    stream: httpx.SyncByteStream | httpx.AsyncByteStream,
    body: CallerBody,
    trace_headers: dict[str, str] | None,
) -> httpx.Response:
    """The caller's response: the decode's status and headers (the length dropped when
    ``body`` recounts it; ``trace_headers`` added, for a P/D call), its body ``stream``."""
    headers = without_trace_headers(response.headers, CONTENT_LENGTH if body.recounted else ())
    if trace_headers is not None:
        headers += raw_headers(trace_headers)
    return httpx.Response(response.status_code, headers=headers, stream=stream, extensions=response.extensions)
