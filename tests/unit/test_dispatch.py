"""Concurrent dispatch's pure parts: the coordinates read from a prefill answer, the book of
prefill servers that get sequential handoffs only, and the first event of a decode stream read for its prompt ids."""

from __future__ import annotations

import orjson
import pytest

from pdclient.handoff import dispatch
from pdclient.wire import MAX_EVENT_BYTES

PARAMS = {"remote_engine_id": "e1", "remote_host": "10.0.0.1", "remote_port": 5600, "tp_size": 1}


def test_coordinates_need_every_field() -> None:
    assert dispatch.Coordinates.from_kv_params(orjson.dumps({**PARAMS, "transfer_mode": "push"})) is not None
    for name in PARAMS:
        assert dispatch.Coordinates.from_kv_params(orjson.dumps({k: v for k, v in PARAMS.items() if k != name})) is None
    for odd in (
        b"",
        b"[]",
        b"{",
        orjson.dumps({**PARAMS, "remote_port": True}),
        orjson.dumps({**PARAMS, "tp_size": 0}),
    ):
        assert dispatch.Coordinates.from_kv_params(odd) is None


def test_a_sequential_only_engine_is_known_until_it_restarts() -> None:
    book = dispatch.CoordinateBook()
    first = book.learn("http://p", orjson.dumps(PARAMS))
    assert first is not None and not book.is_sequential_only(first)
    book.sequential_only(first)
    assert book.is_sequential_only(first)
    restarted = book.learn("http://p", orjson.dumps({**PARAMS, "remote_engine_id": "e2"}))
    assert restarted is not None and not book.is_sequential_only(restarted)


def _event(obj: object) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


CHAT_FIRST = _event({"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant"}}], "prompt_token_ids": [1, 2]})
COMPLETION_FIRST = _event({"id": "c", "choices": [{"index": 0, "text": "", "prompt_token_ids": [3, 4]}]})


@pytest.mark.parametrize(
    ("chat", "chunks", "ids"),
    [
        (True, [CHAT_FIRST], [1, 2]),
        (True, [CHAT_FIRST[:7], CHAT_FIRST[7:]], [1, 2]),  # split across reads
        (True, [b": keep-alive\n\n" + CHAT_FIRST], [1, 2]),  # a comment first
        (False, [COMPLETION_FIRST], [3, 4]),
        (True, [COMPLETION_FIRST], None),  # ids where chat has none
        (True, [_event({"choices": []})], None),
        (True, [_event({"prompt_token_ids": [1, "x"]})], None),
        (True, [_event({"prompt_token_ids": []})], None),
        (True, [b"data: not json\n\n"], None),
        (True, [_event([1, 2])], None),
        (True, [b"data: [DONE]\n\n"], None),
    ],
)
def test_the_first_event_gives_the_prompt_ids_or_none(chat: bool, chunks: list[bytes], ids: list[int] | None) -> None:
    peek = dispatch.PromptPeek(chat=chat)
    decided = [peek.feed(chunk) for chunk in chunks]
    assert decided[-1] and not any(decided[:-1])
    assert peek.ids == ids


def test_a_first_event_without_end_is_given_up() -> None:
    peek = dispatch.PromptPeek(chat=True)
    assert not peek.feed(b"data: " + b"1," * 1000)
    assert peek.feed(b"1," * MAX_EVENT_BYTES)
    assert peek.ids is None


def test_the_same_server_is_recognised_without_a_parse() -> None:
    book = dispatch.CoordinateBook()
    raw = orjson.dumps({**PARAMS, "remote_block_ids": list(range(2048)), "transfer_mode": "push"})
    first = book.learn("http://p", raw)
    assert first is not None and first.named_in(raw)
    assert book.learn("http://p", raw) is first
    for changed in ({"remote_engine_id": "e2"}, {"remote_port": 5601}, {"transfer_mode": "pull"}):
        again = book.learn("http://p", orjson.dumps({**PARAMS, "transfer_mode": "push", **changed}))
        assert again is not None and again is not first and not again.named_in(raw)
        book.learn("http://p", raw)
    assert book.learn("http://p", orjson.dumps({"do_remote_prefill": True})) is None
    assert book.get("http://p") is None


def test_the_coordinate_book_is_a_field_of_its_fleet() -> None:
    # Every copy of a client that shares a fleet shares what it learnt; a new fleet starts blank.
    from pdclient import PDOptions
    from pdclient.fleet import Fleet

    options = PDOptions(prefill_base_url="http://p", decode_base_url="http://d")
    fleet = Fleet(options, asynchronous=False)
    assert isinstance(fleet.coordinates, dispatch.CoordinateBook)
    fleet.coordinates.learn("http://p", orjson.dumps({**PARAMS, "transfer_mode": "push"}))
    assert fleet.coordinates.get("http://p") is not None
    assert Fleet(options, asynchronous=False).coordinates.get("http://p") is None
