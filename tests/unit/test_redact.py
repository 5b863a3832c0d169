"""A base URL's credentials (``http://user:password@host``) are never shown: not in a trace,
an error, a metric label or an endpoint's state, whether as a URL or inside a message."""

from __future__ import annotations

import pytest

from pdclient import PDConfigError, PDOptions, PDTrace
from pdclient._trace import Migration
from pdclient.metrics import endpoint_states
from pdclient.pools import AllEndpointsOpen, EndpointPool
from pdclient.wire import redact_url

SECRET = "s3cret"
URL = f"http://user:{SECRET}@decode:8200/v1"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (URL, "http://***@decode:8200/v1"),
        ("https://token@h/v1", "https://***@h/v1"),
        ("http://u:p%40ss@h/v1", "http://***@h/v1"),
        ("http://u:p@ss@h:1", "http://***@h:1"),  # the userinfo ends at the last @ before the host
        ("http://h/v1/models/a@b", "http://h/v1/models/a@b"),  # an @ in the path is not userinfo
        ("http://h:8000/v1?to=a@b", "http://h:8000/v1?to=a@b"),
        ("no URL, mail@example.com", "no URL, mail@example.com"),
        (
            f"every decode endpoint is open: {URL} (open), http://other:1/v1 (open); URL('{URL}')",
            "every decode endpoint is open: http://***@decode:8200/v1 (open), http://other:1/v1 (open); "
            "URL('http://***@decode:8200/v1')",
        ),
        ("", ""),
    ],
)
def test_redact_url(text: str, expected: str) -> None:
    assert redact_url(text) == expected


def test_a_trace_never_holds_credentials() -> None:
    move = Migration(from_url=URL, to_url=URL, after_tokens=3, cause=f"reset by {URL}")
    trace = PDTrace(
        request_id="r",
        route="chat",
        prefill_url=URL,
        decode_url=URL,
        prefill_warm_up_url=URL,
        fallback=f"prefill failed, sent to {URL}: ConnectError",
        error=f"decode stream broke ({URL})",
        migrations=(move,),
    )
    assert SECRET not in repr(trace) and SECRET not in str(trace.to_headers())
    assert trace.decode_url == "http://***@decode:8200/v1" and trace.migrations[0].to_url == trace.decode_url
    headers = {"x-pd-decode-url": URL, "x-pd-error": f"at {URL}"}
    assert SECRET not in repr(PDTrace.from_headers(headers))


def test_an_open_pool_names_its_endpoints_without_credentials() -> None:
    pool = EndpointPool("decode", (URL, "http://other:1/v1"))
    for endpoint in pool.endpoints:
        endpoint.trip()
    with pytest.raises(AllEndpointsOpen) as caught:
        pool.candidates()
    assert "http://***@decode:8200/v1 (open)" in str(caught.value) and SECRET not in str(caught.value)
    assert SECRET not in repr(pool.endpoints[0]) and pool.endpoints[0].url == URL  # still sent to


def test_endpoint_states_show_no_credentials() -> None:
    from pdclient.fleet import Fleet

    fleet = Fleet(PDOptions(prefill_base_url=URL, decode_base_url=URL), asynchronous=True)
    assert {s.url for s in endpoint_states(fleet)} == {"http://***@decode:8200/v1"}


@pytest.mark.parametrize(
    ("urls", "message"),
    [([URL, URL], "lists the same URL twice"), ([f"ftp://user:{SECRET}@h/v1"], "is not an http\\(s\\) URL")],
)
def test_url_errors_show_no_credentials(urls: list[str], message: str) -> None:
    with pytest.raises(PDConfigError, match=message) as caught:
        PDOptions(prefill_base_url=urls, decode_base_url="http://d:1/v1")
    assert SECRET not in str(caught.value) and "***@" in str(caught.value)
