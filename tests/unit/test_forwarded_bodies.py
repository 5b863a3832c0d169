"""What pdclient refuses to forward, on bytes: a ``kv_transfer_params`` it did not write,
however the body spells it, and the tenant in conversation keys."""

from __future__ import annotations

import json

import pytest

from pdclient.wire import (
    Kind,
    Refusal,
    UploadScan,
    affinity_key,
    check_content_encoding,
    check_forwarded_body,
    kv_params_in_json,
    plan_call,
)

MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("content", "where"),
    [
        (b'{"kv_transfer_params":{}}', "kv_transfer_params"),
        (b'{"kv\\u005ftransfer\\u005Fparams":{}}', "kv_transfer_params"),
        (b'{"a":[{"b":{"kv_transfer_params":1}}]}', "a[0].b.kv_transfer_params"),
        (b'{"vllm_xargs":"{\\"kv_transfer_params\\":[]}"}', "vllm_xargs.kv_transfer_params"),
        (b'{"x":NaN,"kv_transfer_params":null}', "kv_transfer_params"),
        (b'\xef\xbb\xbf{"kv_transfer_params":1}', "kv_transfer_params"),
        (json.dumps({"kv_transfer_params": 1}).encode("utf-32"), "kv_transfer_params"),
        (b'{"input":"kv_transfer_params"}', None),
        (b'{"input":"\\u00e9"}', None),
        (b"kv_transfer_params=1", None),  # not JSON: no server reads a field of it
        (b"", None),
    ],
)
def test_where_a_json_body_holds_the_field(content: bytes, where: str | None) -> None:
    assert kv_params_in_json(content) == where


def test_nesting_too_deep_to_check_is_refused_and_the_message_stays_short() -> None:
    deep = b'{"kv_transfer_params":1,"a":' + b"[" * 5000 + b"]" * 5000 + b"}"
    with pytest.raises(Refusal, match="nested deeper than pdclient can check"):
        check_forwarded_body(deep, "application/json", None)
    nested = b"[" * 900 + b'{"kv_transfer_params":1}' + b"]" * 900
    with pytest.raises(Refusal, match=r"found at \[0\]\[0\].*\.\.\..*\[0\]\.kv_transfer_params$") as raised:
        check_forwarded_body(nested, None, None)
    assert len(str(raised.value)) < 250


@pytest.mark.parametrize("coding", ["gzip", "x-gzip", "deflate", "br", "zstd", "identity, gzip", "GZIP"])
def test_a_compressed_body_is_refused(coding: str) -> None:
    with pytest.raises(Refusal, match="content-encoding"):
        check_content_encoding(coding)


@pytest.mark.parametrize("coding", [None, "", "identity", " Identity "])
def test_an_uncompressed_body_passes(coding: str | None) -> None:
    check_content_encoding(coding)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 64])
@pytest.mark.parametrize("marker", [b"vllm_xargs", b"kv_transfer_params"])
def test_an_upload_is_refused_however_it_is_cut_into_chunks(size: int, marker: bytes) -> None:
    body = b'--b\r\nContent-Disposition: form-data; name="' + marker + b'"\r\n\r\n{}\r\n--b--\r\n'
    scan = UploadScan()
    fed = 0
    with pytest.raises(Refusal, match=marker.decode()):
        for start in range(0, len(body), size):
            scan.feed(body[start : start + size])
            fed = start + size
    assert fed < body.index(marker) + len(marker), "refused before the marker's last byte went on"


def test_an_upload_must_start_with_its_boundary() -> None:
    with pytest.raises(Refusal, match="must start with its boundary"):
        UploadScan().feed(b'{"kv\\u005ftransfer_params":1}')
    scan = UploadScan()
    scan.feed(b"-")
    with pytest.raises(Refusal, match="must start with its boundary"):
        scan.feed(b"{")
    scan = UploadScan()
    for chunk in (b"", b"-", b"-b\r\n", b"\x00" * 100, b"--b--\r\n"):
        scan.feed(chunk)


def test_an_url_encoded_form_is_read_percent_decoded() -> None:
    form = "application/x-www-form-urlencoded"
    with pytest.raises(Refusal, match="vllm_xargs in a form"):
        check_forwarded_body(b"model=w&vllm%5fxargs=%7B%7D", form, None)
    with pytest.raises(Refusal, match="kv_transfer_params is written by pdclient"):
        check_forwarded_body(b"kv+transfer_params=1&kv%5Ftransfer%5Fparams=1", form, None)
    check_forwarded_body(b"model=w&language=en", form, None)


def test_a_tenants_conversations_are_its_own() -> None:
    plain = affinity_key(Kind.CHAT, MESSAGES, None, None)
    keys = {
        plain,
        affinity_key(Kind.CHAT, MESSAGES, None, None, "a"),
        affinity_key(Kind.CHAT, MESSAGES, None, None, "b"),
        affinity_key(Kind.CHAT, MESSAGES, None, "s", "a"),
        affinity_key(Kind.CHAT, MESSAGES, None, "s", "b"),
        # A tenant name that spells another's prefix cannot reach its keys.
        affinity_key(Kind.CHAT, MESSAGES, None, "x|session:s", "a"),
        affinity_key(Kind.CHAT, MESSAGES, None, "s", "a|session:x"),
    }
    assert len(keys) == 7
    body = json.dumps({"model": "m", "messages": MESSAGES}).encode()
    plan = plan_call(Kind.CHAT, body, "a")
    assert plan.tenant == "a" and plan.affinity_key == affinity_key(Kind.CHAT, MESSAGES, None, None, "a")
    assert plan_call(Kind.CHAT, body).affinity_key == plain
