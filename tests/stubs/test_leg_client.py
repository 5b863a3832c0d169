"""How the legs go out (pdclient/transport/_leg_client.py, ``Call._leg_request``), on real sockets: no
cookie jar of their own, credentials from the URL, a streamed body with its framing."""

from __future__ import annotations

import base64

from tests.stubserver import StubServer
from tests.twins import Twin

MESSAGES = [{"role": "user", "content": "Hello"}]


async def test_a_cookie_one_server_set_is_not_sent_on_later_calls(mode: str) -> None:
    """A server's Set-Cookie is the caller's client's to keep, not the legs': were the legs to
    keep and send cookies, every later call (in ``pdclient serve``, every other caller's)
    would carry it."""
    with StubServer() as prefill, StubServer() as decode:
        prefill.set_cookie = "sticky=prefill-1; Path=/"
        twin = Twin(mode, prefill_base_url=prefill.url, decode_base_url=decode.url)
        for _ in range(2):
            await twin.chat(messages=MESSAGES, max_tokens=4)
        assert [leg.headers.get("cookie") for leg in prefill.legs("prefill")] == [None, None]
        # The caller's own cookies still reach both legs, as any header of theirs does.
        await twin.chat(messages=MESSAGES, max_tokens=4, extra_headers={"cookie": "mine=1"})
        assert prefill.legs("prefill")[-1].headers["cookie"] == "mine=1"
        assert decode.legs("decode")[-1].headers["cookie"] == "mine=1"
        await twin.close()


async def test_credentials_in_a_url_are_sent_as_basic_auth(mode: str) -> None:
    """As httpx's client sends them (a server behind a proxy that wants Basic auth)."""
    with StubServer() as prefill, StubServer() as decode:
        with_user = prefill.url.replace("http://", "http://user:pa%20ss@")
        twin = Twin(mode, prefill_base_url=with_user, decode_base_url=decode.url)
        await twin.chat(messages=MESSAGES, max_tokens=4)
        expected = "Basic " + base64.b64encode(b"user:pa ss").decode()
        assert prefill.legs("prefill")[0].headers["authorization"] == expected
        await twin.close()


async def test_a_multipart_upload_passes_through_with_its_framing(mode: str) -> None:
    """The caller's body stream goes on unread, so its Content-Length (or chunked framing)
    goes with it: without either, h11 would declare an empty body and refuse to send it."""
    with StubServer() as stub:
        twin = Twin(mode, prefill_base_url=stub.url, decode_base_url=stub.url)
        content = "é\n".encode() * 5000
        created = await twin.call(twin.client.files.create, file=("a.jsonl", content), purpose="batch")
        (upload,) = stub.received
        assert upload.path == "/v1/files" and created.bytes == len(upload.raw_body)
        assert b'filename="a.jsonl"' in upload.raw_body and content in upload.raw_body
        await twin.close()
