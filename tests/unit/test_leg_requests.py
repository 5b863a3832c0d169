"""``request_with_content`` builds what ``httpx.Request(content=...)`` builds, without its re-scans."""

from __future__ import annotations

import httpx
import pytest

from pdclient.handoff import request_with_content

URL = httpx.URL("http://decode:8200/v1/chat/completions")
HEADERS = [(b"host", b"decode:8200"), (b"content-type", b"application/json"), (b"x-user", "Zoë".encode())]


@pytest.mark.parametrize(("method", "content"), [("POST", b'{"a": 1}'), ("POST", b""), ("GET", b""), ("PUT", b"x")])
def test_same_request_as_httpx_builds(method: str, content: bytes) -> None:
    ours = request_with_content(method, URL, HEADERS, content, {"timeout": {"read": 5}})
    theirs = httpx.Request(method, URL, headers=HEADERS, content=content, extensions={"timeout": {"read": 5}})
    assert sorted(ours.headers.multi_items()) == sorted(theirs.headers.multi_items())  # names lower-cased
    assert ours.content == theirs.content == content
    assert ours.extensions == theirs.extensions and ours.method == method and ours.url == URL
    assert b"".join(ours.stream) == content  # type: ignore[arg-type]
