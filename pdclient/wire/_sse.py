"""Server-sent events on bytes: the one place pdclient splits a body into events.

The rules are the WHATWG event-stream's: a line ends with CRLF, LF or CR, and an event
ends at a blank line, so ``\\n\\n``, ``\\r\\n\\r\\n`` and ``\\r\\r`` (or any two line ends in a
row) close one. An event's ``data`` is its ``data:`` lines' values (one leading space cut),
joined by ``\\n``; comments (``:``) and other fields are kept in the bytes and ignored.
``SSEFramer`` works across network reads: a partial event waits for its end, up to
``MAX_EVENT_BYTES`` (past it, ``EventTooLarge``: a step never gets half an event). An event
is the exact bytes the server sent (its blank line included), so a body passed on event
by event is byte for byte the body that came in; ``event_data`` reads its data, once,
where it is needed (a framer that paid for every event's data would cost a stream that
only passes bytes on).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import orjson

from ._error_body import error_body

DONE = b"[DONE]"
"""The data of the last event of an OpenAI-style stream."""

_DONE_EVENT = b"data: " + DONE
_DONE_TAIL = 32
# Two line ends in a row; a CR followed by LF is one line end, never two.
_BLANK_LINE = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r|\n)")
_LINE_END = re.compile(rb"\r\n|\r|\n")

MAX_EVENT_BYTES = 16 << 20
"""The longest event pdclient holds to handle it whole (16 MiB). A Responses answer echoes
its whole response object (``instructions``, ``tools``, the output so far) in its lifecycle
events, and a chat stream's first event carries the prompt's token ids (~8 bytes each):
both stay far below this for any prompt a server takes. An event still without its end
past it is not one to handle: the call fails (``EventTooLarge``) at the read that passes it."""


class EventTooLarge(ValueError):
    """An event of a stream pdclient handles event by event passed ``MAX_EVENT_BYTES``."""

    def __init__(self, held: int) -> None:
        super().__init__(
            f"an event of the decode's stream is longer than {MAX_EVENT_BYTES >> 20} MiB "
            "(MAX_EVENT_BYTES), the most pdclient holds to handle one event whole; the stream ends there"
        )
        self.held = held


def error_event(message: str, code: int = 502) -> bytes:
    """An event that ends a stream with an error, in the shape both SDKs raise on: the openai
    SDK raises ``APIError`` with the message for any event whose data has an ``error``, the
    anthropic SDK its status error for an ``error`` event."""
    error = {"type": "error", "error": error_body(message, code)}
    return b"event: error\ndata: " + orjson.dumps(error) + b"\n\n"


def event_data(raw: bytes) -> bytes | None:
    """The ``data`` of one event's bytes (its blank line may be included); None without a data line."""
    if raw.startswith(b"data: ") and raw.find(b"\n") == len(raw) - 2 and raw.endswith(b"\n\n") and b"\r" not in raw:
        return raw[6:-2]  # vLLM's events: one data line, the whole value on it
    data: list[bytes] = []
    for line in _LINE_END.split(raw):
        if line == b"data" or line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(data) if data else None


def single_line_data(data: bytes) -> list[bytes] | None:
    """The data of each event in ``data`` (whole events, LF line ends: ``SSEFramer.whole``)
    when every one is a single ``data: `` line, as vLLM sends them; None when any is not
    (a comment, another field, a data value over several lines): frame those instead."""
    if not data.startswith(b"data: ") or not data.endswith(b"\n\n"):
        return None
    values = data[6:-2].split(b"\n\ndata: ")
    # Each event's two line ends, and no other: no value holds a line end of its own.
    return values if data.count(b"\n") == 2 * len(values) else None


def is_done(data: bytes | None) -> bool:
    """Whether an event's data is the stream's ``[DONE]``."""
    return data is not None and (data == DONE or (len(data) < 16 and data.strip() == DONE))


def split_events(data: bytes, start: int = 0) -> tuple[list[bytes], int]:
    """The whole events in ``data`` from ``start`` (each one's bytes, its blank line
    included), and where the first partial one begins."""
    events: list[bytes] = []
    if b"\r" not in data:
        while (end := data.find(b"\n\n", start)) >= 0:
            events.append(data[start : end + 2])
            start = end + 2
        return events, start
    while (match := _BLANK_LINE.search(data, start)) is not None:
        events.append(data[start : match.end()])
        start = match.end()
    return events, start


class SSEFramer:
    """An event stream as it arrives: ``feed`` the bytes read, get the events they completed.

    An event that spans reads gathers in one buffer, and each read is searched for its end
    only where the read's bytes are (not the whole event again), so a long event costs its
    length, not its length times its reads. One longer than ``MAX_EVENT_BYTES`` raises
    ``EventTooLarge`` at the read that passes the bound (or at ``rest``).
    """

    __slots__ = ("_after_cr", "_held")

    def __init__(self) -> None:
        self._held = bytearray()
        self._after_cr = False

    def feed(self, data: bytes) -> list[bytes]:
        """The bytes of each event ``data`` completed."""
        held = self._held
        if held:
            _check_length(len(held))  # a read longer than the bound held it: refused now
            # A blank line that ends the held event may begin up to 3 bytes before ``data``.
            searched = max(len(held) - 3, 0)
            held += data
            end = _BLANK_LINE.search(held, searched)
            _check_length(len(held) if end is None else end.end())
            if end is None:
                return []
            buffer = bytes(held)
            held.clear()
        else:
            buffer = data
        if buffer.endswith(b"\n\n") and buffer.find(b"\n\n") == len(buffer) - 2 and b"\r" not in buffer:
            self._after_cr = False
            return [buffer]  # most network reads of a stream: one whole event
        lf: list[bytes] = []
        if self._after_cr and buffer.startswith(b"\n"):
            # The last event ended a read with a CR; this LF completes that CRLF. It goes on
            # at once, as an event with no data, so nothing waits for it.
            lf, buffer = [b"\n"], buffer[1:]
        events, start = split_events(buffer)
        self._after_cr = bool(events) and start == len(buffer) and buffer.endswith(b"\r")
        held += memoryview(buffer)[start:]
        return lf + events if lf else events

    def whole(self, data: bytes) -> bool:
        """Whether ``data`` is whole events from the start of one (nothing held from the reads
        before, its end a blank line): a step that leaves them all as they are may pass it on
        without ``feed``, and the framer is where it was."""
        return not self._held and not self._after_cr and data.endswith(b"\n\n") and b"\r" not in data

    @property
    def pending(self) -> int:
        """Bytes of an event not yet ended."""
        return len(self._held)

    def rest(self) -> bytes:
        """The bytes of an event not yet ended, which the framer then forgets (the body ended)."""
        rest = bytes(self._held)
        self._held.clear()
        self._after_cr = False
        _check_length(len(rest))
        return rest


def _check_length(held: int) -> None:
    if held > MAX_EVENT_BYTES:
        raise EventTooLarge(held)


def ends_event_stream(chunk: bytes) -> bool:
    """Whether a body's last bytes hold ``data: [DONE]``, the stream's last event: a cheap
    look at a chunk's end, for a body passed on without being framed."""
    return _DONE_EVENT in chunk[-_DONE_TAIL:]


def stream_tail(previous: bytes, chunk: bytes) -> bytes:
    """The body's last bytes after ``chunk`` (a network read may end inside ``data: [DONE]``)."""
    return (previous + chunk[-_DONE_TAIL:])[-_DONE_TAIL:]


def pass_events(framer: SSEFramer, data: bytes, each: Callable[[bytes], bytes]) -> bytes:
    """The events ``data`` completed, each as ``each`` rewrites it (b"": left out): the one
    way a step that passes a stream on in whole events frames it (``EventTooLarge`` past
    ``MAX_EVENT_BYTES``: never half an event)."""
    return b"".join([each(event) for event in framer.feed(data)])


class ParsedEvent(bytes):
    """A whole event whose data a step has parsed already (``payload``, as ``event_json``
    would give it for these bytes): the steps after it read that, not the bytes again."""

    payload: object

    def __new__(cls, raw: bytes, payload: object) -> ParsedEvent:
        event = super().__new__(cls, raw)
        event.payload = payload
        return event


def event_json(raw: bytes) -> object:
    """One event's data as JSON, parsed once for every step that reads it: None for an event
    without data or the stream's ``[DONE]``; the data's bytes when they are not JSON."""
    if type(raw) is ParsedEvent:
        return raw.payload
    data = event_data(raw)
    if data is None or is_done(data):
        return None
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return data
