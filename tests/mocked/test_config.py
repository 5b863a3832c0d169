"""Construction: settings resolved and validated at once, with errors that name the setting."""

from __future__ import annotations

import httpx
import pytest

import pdclient
from pdclient import AsyncPDChatClient, AsyncPDTransport, PDChatClient, PDConfigError, PDOptions, PDTransport
from tests.fake_vllm import DECODE, PREFILL

CLIENTS = [PDChatClient, AsyncPDChatClient]


def test_public_surface_is_pinned() -> None:
    assert sorted(pdclient.__all__) == sorted(
        [
            "AsyncPDChatClient",
            "AsyncPDTransport",
            "BreakerSettings",
            "CacheAware",
            "CallView",
            "ConversationSettings",
            "CostDecision",
            "DiscoverySettings",
            "HealthSettings",
            "LegView",
            "LoadAware",
            "Outcome",
            "PDChatClient",
            "PDConfigError",
            "PDError",
            "PDObserver",
            "PDOptions",
            "PDSetupError",
            "PDTrace",
            "PDTransport",
            "RetrySettings",
            "RouteDecision",
            "RouteRequest",
            "RoutingPolicy",
            "ScrapeSettings",
            "__version__",
        ]
    )


@pytest.mark.parametrize("client_type", CLIENTS)
def test_missing_urls_fail_at_construction(client_type: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCLIENT_PREFILL_BASE_URL", raising=False)
    monkeypatch.delenv("PDCLIENT_DECODE_BASE_URL", raising=False)
    with pytest.raises(PDConfigError, match=r"prefill_base_url is required.*PDCLIENT_PREFILL_BASE_URL"):
        client_type(decode_base_url=DECODE, api_key="k")
    with pytest.raises(PDConfigError, match=r"decode_base_url is required.*PDCLIENT_DECODE_BASE_URL"):
        client_type(prefill_base_url=PREFILL, api_key="k")


@pytest.mark.parametrize("client_type", CLIENTS)
def test_urls_from_environment_comma_separated(client_type: type, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDCLIENT_PREFILL_BASE_URL", " http://p1:1/v1, http://p2:1/v1/ ")
    monkeypatch.setenv("PDCLIENT_DECODE_BASE_URL", "http://d1:2/v1")
    client = client_type(api_key="k")
    assert client.pd_options.prefill_urls == ("http://p1:1/v1", "http://p2:1/v1")
    assert client.pd_options.decode_urls == ("http://d1:2/v1",)


@pytest.mark.parametrize("client_type", CLIENTS)
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"prefill_base_url": []}, "prefill_base_url is an empty list"),
        ({"prefill_base_url": "ftp://x/v1"}, "prefill_base_url: 'ftp://x/v1' is not an http"),
        ({"decode_base_url": ["http://d:1/v1", 5]}, "decode_base_url: expected a URL string, got int"),
        ({"on_prefill_failure": "retry"}, "on_prefill_failure must be one of"),
        ({"on_trace": "print"}, "on_trace must be callable"),
        ({"base_url": "http://elsewhere/v1"}, "base_url 'http://elsewhere/v1' is not one of decode_base_url"),
        ({"http_client": "not-a-client"}, "http_client must be"),
        ({"routng": "affinity"}, "unknown argument 'routng'; did you mean 'routing'? Known: "),
        ({"max_retry": 2}, "unknown argument 'max_retry'; did you mean 'max_retries'?"),
        ({"zzz": 1}, "unknown argument 'zzz' Known: "),
    ],
)
def test_bad_settings_name_what_is_wrong(client_type: type, kwargs: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"prefill_base_url": PREFILL, "decode_base_url": DECODE, "api_key": "k", **kwargs}
    with pytest.raises(PDConfigError) as excinfo:
        client_type(**arguments)
    assert message in str(excinfo.value)


def test_foreign_http_client_is_refused_with_the_fix() -> None:
    with pytest.raises(PDConfigError, match=r"http_client must be an Client\(transport=PDTransport"):
        PDChatClient(prefill_base_url=PREFILL, decode_base_url=DECODE, api_key="k", http_client=httpx.Client())


def test_own_pd_http_client_is_used_as_given() -> None:
    transport = PDTransport(options=PDOptions(PREFILL, DECODE, on_prefill_failure="fail"))
    http = httpx.Client(transport=transport)
    client = PDChatClient(api_key="k", http_client=http)
    assert client._client is http and client.pd_options is transport.options
    atransport = AsyncPDTransport(PREFILL, DECODE)
    ahttp = httpx.AsyncClient(transport=atransport)
    aclient = AsyncPDChatClient(api_key="k", http_client=ahttp)
    assert aclient._client is ahttp and aclient.pd_options is atransport.options


def test_explicit_settings_win_over_a_pd_http_client_and_share_its_connections() -> None:
    transport = PDTransport(PREFILL, DECODE)
    client = PDChatClient(
        prefill_base_url="http://p2:1/v1",
        decode_base_url=DECODE,
        api_key="k",
        http_client=httpx.Client(transport=transport),
    )
    assert client.pd_options.prefill_urls == ("http://p2:1/v1",)
    assert client._client._transport._legs is transport._legs  # type: ignore[attr-defined]


def test_base_url_may_name_a_decode_endpoint() -> None:
    client = PDChatClient(
        prefill_base_url=PREFILL, decode_base_url=[DECODE, "http://d2:1/v1"], base_url="http://d2:1/v1/", api_key="k"
    )
    assert str(client.base_url) == "http://d2:1/v1/"


def test_config_error_is_a_value_error() -> None:
    assert issubclass(PDConfigError, ValueError) and issubclass(PDConfigError, pdclient.PDError)


@pytest.mark.parametrize("method", [PDChatClient.__init__, PDChatClient.copy])
def test_every_pd_option_is_a_typed_keyword_argument(method: object) -> None:
    """The clients' typed keyword arguments and PDOptions' fields are the same list."""
    import inspect

    parameters = inspect.signature(method).parameters  # type: ignore[arg-type]
    assert set(PDOptions.names()) <= set(parameters), set(PDOptions.names()) - set(parameters)
    assert {"options", *PDOptions.names()} == {
        name for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY and name not in ("base_url", "http_client")
    }


# Every duration field of the options' settings objects, and whether 0 s makes sense there.
DURATION_FIELDS = [
    (pdclient.BreakerSettings, "cooldown", "breaker.cooldown", True),
    (pdclient.RetrySettings, "backoff_initial", "retries.backoff_initial", True),
    (pdclient.RetrySettings, "backoff_max", "retries.backoff_max", True),
    (pdclient.RetrySettings, "prefill_timeout", "retries.prefill_timeout", False),
    (pdclient.HealthSettings, "interval", "HealthSettings.interval", False),
    (pdclient.HealthSettings, "timeout", "HealthSettings.timeout", False),
    (pdclient.DiscoverySettings, "interval", "DiscoverySettings.interval", False),
    (pdclient.ScrapeSettings, "interval", "ScrapeSettings.interval", False),
    (pdclient.ScrapeSettings, "staleness", "ScrapeSettings.staleness", False),
    (pdclient.ScrapeSettings, "timeout", "ScrapeSettings.timeout", False),
]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf"), -1, True])
@pytest.mark.parametrize(("kind", "name", "shown", "zero"), DURATION_FIELDS, ids=lambda v: getattr(v, "__name__", v))
def test_every_duration_refuses_nan_infinity_and_negatives(
    kind: type, name: str, shown: str, zero: bool, value: object
) -> None:
    """A NaN compares false with everything, so a bound written as ``value < 0`` let it through."""
    with pytest.raises(PDConfigError, match=f"{shown} must be a finite number of seconds {'>=' if zero else '>'} 0"):
        kind(**{name: value})


@pytest.mark.parametrize(("kind", "name", "shown", "zero"), DURATION_FIELDS, ids=lambda v: getattr(v, "__name__", v))
def test_zero_seconds_only_where_it_means_something(kind: type, name: str, shown: str, zero: bool) -> None:
    if zero:
        assert getattr(kind(**{name: 0}), name) == 0
    else:
        with pytest.raises(PDConfigError, match=shown):
            kind(**{name: 0})


def test_every_duration_field_is_listed() -> None:
    """A new duration field gets the same check: list it above."""
    import dataclasses

    listed = {(kind, name) for kind, name, _, _ in DURATION_FIELDS}
    for kind in {kind for kind, *_ in DURATION_FIELDS}:
        for f in dataclasses.fields(kind):
            if "float" in str(f.type):
                assert (kind, f.name) in listed, f"{kind.__name__}.{f.name}"
