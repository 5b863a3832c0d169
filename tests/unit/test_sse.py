"""The SSE framer: one table of framings, each fed whole and byte by byte; long events."""

from __future__ import annotations

import pytest

from pdclient.wire import MAX_EVENT_BYTES, EventTooLarge, SSEFramer, event_data, is_done, split_events

# (body, the events' data in order, the bytes left as a partial event)
CASES = [
    ("lf", b'data: {"a":1}\n\ndata: [DONE]\n\n', [b'{"a":1}', b"[DONE]"], b""),
    ("crlf", b'data: {"a":1}\r\n\r\ndata: [DONE]\r\n\r\n', [b'{"a":1}', b"[DONE]"], b""),
    ("cr", b'data: {"a":1}\r\rdata: [DONE]\r\r', [b'{"a":1}', b"[DONE]"], b""),
    ("mixed line ends", b"data: a\r\n\ndata: b\n\r\n", [b"a", b"b"], b""),
    ("comment", b": keep-alive\n\ndata: x\n\n", [None, b"x"], b""),
    ("comment inside", b": ping\ndata: x\n\n", [b"x"], b""),
    ("multi-line data", b"data: a\ndata: b\r\ndata:c\n\n", [b"a\nb\nc"], b""),
    ("other fields", b"event: message\nid: 7\ndata: x\nretry: 10\n\n", [b"x"], b""),
    ("data without a colon", b"data\n\n", [b""], b""),
    ("trailing partial", b"data: a\n\ndata: b", [b"a"], b"data: b"),
    ("one line end is not an event's end", b"data: a\r\n", [], b"data: a\r\n"),
    ("trailing [DONE] without its blank line", b"data: a\n\ndata: [DONE]\n", [b"a"], b"data: [DONE]\n"),
    ("data with its space kept past the first", b"data:  two\n\n", [b" two"], b""),
]


@pytest.mark.parametrize(("body", "data", "rest"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_split_events(body: bytes, data: list[bytes | None], rest: bytes) -> None:
    events, start = split_events(body)
    assert [event_data(e) for e in events] == data
    assert body[start:] == rest
    assert b"".join(events) + rest == body  # the bytes as sent, none lost or changed


@pytest.mark.parametrize(("body", "data", "rest"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_framer_across_reads(body: bytes, data: list[bytes | None], rest: bytes) -> None:
    """Split at every byte: the same events' data, and the same bytes in the end. A CR that
    ends a read may be the first half of a CRLF: its LF then starts the next event (empty)."""
    framer = SSEFramer()
    events = [e for i in range(len(body)) for e in framer.feed(body[i : i + 1])]
    assert [event_data(e) for e in events if e.strip()] == data
    assert framer.pending == len(rest)
    assert b"".join(events) + framer.rest() == body
    assert framer.pending == 0


def test_done() -> None:
    events, _ = split_events(b"data: x\n\ndata: [DONE]\r\n\r\ndata:[DONE] \n\n")
    assert [is_done(event_data(e)) for e in events] == [False, True, True]


def test_event_data_without_its_blank_line() -> None:
    assert event_data(b"data: x") == b"x"
    assert event_data(b": comment") is None
    assert event_data(b"data: a\rb\n\n") == b"a"  # a CR ends a line, wherever it stands


@pytest.mark.parametrize("end", [b"\n\n", b"\r\n\r\n", b"\r\r"])
def test_an_event_over_many_reads_is_one_event_as_sent(end: bytes) -> None:
    """A Responses event with 100 KB of instructions takes many network reads: it comes out
    whole, once, whatever read its blank line is split across."""
    long = b"event: response.created\ndata: " + b"x" * 100_000 + end
    body = long + b"data: next" + end + long
    for read in (7, 4096, 65536):
        framer = SSEFramer()
        events = [e for i in range(0, len(body), read) for e in framer.feed(body[i : i + read])]
        assert framer.pending == 0 and b"".join(events) == body
        assert [event_data(e) for e in events if e.strip()] == [b"x" * 100_000, b"next", b"x" * 100_000]


def test_an_event_longer_than_the_bound_raises_at_the_read_that_passes_it() -> None:
    framer = SSEFramer()
    assert framer.feed(b"data: " + b"x" * (MAX_EVENT_BYTES - 8)) == []
    assert framer.feed(b"\n\n") == [b"data: " + b"x" * (MAX_EVENT_BYTES - 8) + b"\n\n"]  # the bound itself passes
    assert framer.feed(b"data: " + b"x" * (MAX_EVENT_BYTES - 8)) == []
    with pytest.raises(EventTooLarge, match=r"longer than 16 MiB \(MAX_EVENT_BYTES\)"):
        framer.feed(b"xxx\n\n")  # ends it, but past the bound: never handed on
    framer = SSEFramer()
    framer.feed(b"data: " + b"x" * MAX_EVENT_BYTES)
    with pytest.raises(EventTooLarge):
        framer.rest()


def test_an_error_event_carries_the_one_error_body_shape() -> None:
    """The OpenAI-style error object is written once (``wire.error_body``): the proxy's JSON
    errors and a stream's error event carry the same."""
    import orjson

    from pdclient.wire import ERROR_TYPE, error_body, error_event

    assert error_body("no such route", 404) == {"message": "no such route", "type": ERROR_TYPE, "code": 404}
    data = error_event("cut", 502).split(b"data: ", 1)[1]
    assert orjson.loads(data) == {"type": "error", "error": error_body("cut", 502)}
