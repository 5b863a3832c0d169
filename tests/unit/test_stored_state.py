"""The tag a stored response's id carries of its decode endpoint: pure functions."""

from __future__ import annotations

import re

import pytest

from pdclient.dialects import (
    IdTags,
    endpoint_for,
    endpoint_tag,
    names_a_response,
    tag_event,
    tag_id,
    tag_json,
    untag_id,
    untag_path,
)

D1, D2 = "http://d1:8200/v1", "http://d2:8200/v1"


def test_a_tag_is_short_stable_and_tells_endpoints_apart() -> None:
    tag = endpoint_tag(D1)
    assert re.fullmatch(r"[a-z2-7]{10}", tag) and tag == endpoint_tag(D1) != endpoint_tag(D2)
    assert tag == "psfal4wsls"  # no random key: every process and replica derives this one
    # The URL's credentials never reach the hash; the redacted URL does.
    assert endpoint_tag("http://user:secret@d1:8200/v1") == endpoint_tag("http://other:key@d1:8200/v1")


@pytest.mark.parametrize("own", ["resp_0123abcd", "resp_a.b.c", "x.pd", "resp_1.pdSHORT", "é"])
def test_round_trip(own: str) -> None:
    tag = endpoint_tag(D1)
    assert untag_id(tag_id(own, tag)) == (own, tag)
    assert tag_id(tag_id(own, tag), endpoint_tag(D2)) == tag_id(own, tag)  # tagged once, by its server


@pytest.mark.parametrize("odd", ["", ".pduw7rtgc7sd", "resp_1.pduw7rtgc7s", "resp_1.pdUW7RTGC7SD", "resp_1"])
def test_odd_or_untagged_ids_carry_no_tag(odd: str) -> None:
    assert untag_id(odd) == (odd, None)
    assert tag_id("", "uw7rtgc7sd") == ""


@pytest.mark.parametrize("odd", [None, 7, ["resp_1"], b"resp_1"])
def test_a_non_string_is_a_clear_error(odd: object) -> None:
    with pytest.raises(TypeError, match="a response id is a string, got"):
        untag_id(odd)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="a response id is a string, got"):
        tag_id(odd, "uw7rtgc7sd")  # type: ignore[arg-type]


def test_endpoint_for_looks_among_the_pool_now() -> None:
    assert endpoint_for(endpoint_tag(D2), [D1, D2]) == D2
    assert endpoint_for(endpoint_tag(D2), [D1]) is None and endpoint_for(None, [D1]) is None


def test_paths_naming_a_response() -> None:
    tag = endpoint_tag(D1)
    assert untag_path(f"/responses/resp_1.pd{tag}") == ("/responses/resp_1", tag)
    assert untag_path(f"/responses/resp_1.pd{tag}/cancel") == ("/responses/resp_1/cancel", tag)
    assert untag_path("/responses/resp_1") == ("/responses/resp_1", None)
    assert untag_path(f"/models/resp_1.pd{tag}") == (f"/models/resp_1.pd{tag}", None)
    assert names_a_response("/responses/resp_1/cancel") and not names_a_response("/responses")


def test_answers_are_tagged_and_otherwise_byte_identical() -> None:
    tag = endpoint_tag(D1)
    body = b'{"id": "resp_1", "text": "resp_1", "previous_response_id":"resp_0", "output": [{"id": "resp_1x"}]}'
    want = body.replace(b'"id": "resp_1"', f'"id": "resp_1.pd{tag}"'.encode())
    want = want.replace(b'"resp_0"', f'"resp_0.pd{tag}"'.encode())
    assert tag_json(body, tag) == want  # the text and the items' ids as sent
    for unchanged in (b"", b"not json", b"[1]", b'{"id": 3}', b'{"error": {"message": "x"}}'):
        assert tag_json(unchanged, tag) == unchanged
    delta = b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"resp_1"}\n\n'
    assert tag_event(delta, tag) == delta
    created = b'event: response.created\r\ndata: {"type":"response.created","response":{"id":"resp_1"}}\r\n\r\n'
    assert tag_event(created, tag) == created.replace(b"resp_1", f"resp_1.pd{tag}".encode())
    assert tag_event(b'data: {"response": [1]}\n\n', tag) == b'data: {"response": [1]}\n\n'


def test_a_stream_split_anywhere_comes_out_the_same() -> None:
    tag = endpoint_tag(D1)
    stream = (
        b'event: response.created\ndata: {"type":"response.created","response":{"id":"resp_1"}}\n\n'
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"Hi"}\n\n'
        b'event: response.completed\ndata: {"type":"response.completed","response":{"id":"resp_1"}}\n\n'
    )
    want = stream.replace(b'"resp_1"', f'"resp_1.pd{tag}"'.encode())
    for cut in range(len(stream)):
        tags = IdTags(tag, stream=True)
        assert tags.feed(stream[:cut]) + tags.feed(stream[cut:]) + tags.end() == want
    whole = IdTags(tag, stream=False)
    assert (
        whole.feed(b'{"id":') == b""
        and whole.feed(b'"resp_1"}') == b""
        and whole.end() == want[:0] + (f'{{"id":"resp_1.pd{tag}"}}'.encode())
    )


def test_tagging_a_huge_id_takes_linear_time_and_compiles_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM echoes a Responses body's ``request_id`` as the response id: an id of megabytes
    must not cost a regex compiled for it (~1 s per MB, on the event loop)."""
    import time

    def no_compile(*args: object, **kwargs: object) -> None:
        raise AssertionError("a regex compiled per answer")

    monkeypatch.setattr(re, "compile", no_compile)
    tag = endpoint_tag(D1)
    huge = "resp_" + "a" * 2_000_000
    body = b'{"id": "%s", "previous_response_id": null, "text": "x"}' % huge.encode()
    started = time.perf_counter()
    tagged = tag_json(body, tag)
    event = b'data: {"type":"response.created","response":{"id":"%s"}}\n\n' % huge.encode()
    assert tag_event(event, tag) == event.replace(b'"}}', f'.pd{tag}"}}}}'.encode())
    assert time.perf_counter() - started < 0.5
    assert tagged == body.replace(b'a", "previous', f'a.pd{tag}", "previous'.encode())
