"""``PDChatClient`` / ``AsyncPDChatClient``: openai clients whose HTTP client does P/D.

The clients are thin: they resolve the P/D settings, build an httpx client around a
``PDTransport`` and hand everything else to ``openai.OpenAI`` unchanged. All the
handoff logic lives in ``_transport`` and ``_handoff``.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import httpx
import openai
from typing_extensions import Self

from ._endpoints import DECODE_ENV, BreakerSettings, RoutingPolicy, URLArg, resolve_urls
from ._errors import PDConfigError
from ._retry import RetrySettings
from ._trace import TraceCallback
from ._transport import AsyncPDTransport, PDSettings, PDTransport

_HttpClient = TypeVar("_HttpClient", httpx.Client, httpx.AsyncClient)

# The openai SDK's own pool limits, kept for the legs so a drop-in client pools alike.
_LEG_LIMITS = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
_UNSET: Any = object()


def _copy_arguments(current: PDSettings, pd_options: dict[str, Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``openai`` copy() arguments that carry a client's P/D settings into its copy.

    Unchanged settings are passed as the same object, so copies share endpoint health
    and in-flight counts; changed ones are resolved anew, the rest taken from ``current``.
    """
    given = {k: v for k, v in pd_options.items() if v is not _UNSET}
    if not given:
        pd: dict[str, Any] = {"_pd_settings": current}
    else:
        pd = {
            "prefill_base_url": list(current.prefill.urls),
            "decode_base_url": list(current.decode.urls),
            "on_trace": current.on_trace,
            "on_prefill_failure": current.on_prefill_failure,
            "routing": current.routing,
            "breaker": current.prefill.breaker,
            "retries": current.retry,
            "reuse_secret": current.reuse_secret,
            **given,
        }
    if "decode_base_url" in given:
        # copy() would otherwise inherit the old decode URL as base_url.
        urls = resolve_urls(given["decode_base_url"], argument="decode_base_url", env=DECODE_ENV)
        kwargs.setdefault("base_url", urls[0])
    return {**kwargs, "_extra_kwargs": {**kwargs.get("_extra_kwargs", {}), **pd}}


def _settings_for(
    inherited: PDSettings | None,
    http_client: object,
    transport_type: type[PDTransport] | type[AsyncPDTransport],
    **options: Any,
) -> PDSettings:
    """A client's P/D settings: a copy's inherited ones, else those of a P/D-wired
    ``http_client`` given without endpoint arguments, else resolved from the arguments."""
    if inherited is not None:
        return inherited
    transport = getattr(http_client, "_transport", None)
    no_endpoints = options["prefill_base_url"] is None and options["decode_base_url"] is None
    if isinstance(transport, transport_type) and no_endpoints:
        return transport.settings
    return PDSettings.resolve(**options)


def _api_base(settings: PDSettings, base_url: object) -> str:
    """The SDK's base URL: a decode URL, since every non-P/D request goes to decode."""
    if base_url is None or isinstance(base_url, openai.NotGiven):
        return settings.decode.urls[0]
    given = str(base_url).rstrip("/")
    if settings.decode.base_of(given) != given:
        raise PDConfigError(
            f"base_url {given!r} is not one of decode_base_url {list(settings.decode.urls)}; "
            "a P/D client sends to decode_base_url, so leave base_url out"
        )
    return given


def _wire(
    http_client: _HttpClient | None,
    settings: PDSettings,
    transport_type: type[PDTransport] | type[AsyncPDTransport],
    client_type: type[_HttpClient],
    leg_transport_type: type[httpx.HTTPTransport] | type[httpx.AsyncHTTPTransport],
) -> _HttpClient:
    """An httpx client whose transport does the handoff with ``settings``.

    A copy of a client (``with_options``) passes the original's httpx client back in:
    it is reused as is when the P/D settings are unchanged, and otherwise its leg
    connections are shared by a new transport, as ``openai`` shares its pool in copies.
    """
    # Any: the sync and async pairs are matched by the two call sites, not by the types.
    transport: Any
    legs: Any
    if http_client is None:
        legs = leg_transport_type(limits=_LEG_LIMITS)
        transport = transport_type(settings=settings, leg_transport=legs)
        return client_type(transport=transport, follow_redirects=True)
    current = getattr(http_client, "_transport", None)
    if not isinstance(current, transport_type):
        raise PDConfigError(
            f"http_client must be an {client_type.__name__}(transport={transport_type.__name__}(...)), "
            f"or left out; got one with transport {type(current).__name__}"
        )
    if current.settings is settings:
        return http_client
    # type(current): a subclass (the OpenTelemetry transport) survives with_options().
    legs = current._legs
    transport = type(current)(settings=settings, leg_transport=legs)
    return client_type(transport=transport, follow_redirects=True, timeout=http_client.timeout)


class _PDClient:
    """The P/D part of both clients, written once: settings, the wired httpx client, copy().

    Mixed in before ``openai.OpenAI`` / ``openai.AsyncOpenAI``; the twins only name
    their transport and httpx types.
    """

    _transport_type: ClassVar[type[PDTransport] | type[AsyncPDTransport]]
    _http_client_type: ClassVar[type[httpx.Client] | type[httpx.AsyncClient]]
    _leg_transport_type: ClassVar[type[httpx.HTTPTransport] | type[httpx.AsyncHTTPTransport]]
    pd_settings: PDSettings

    def __init__(
        self,
        *,
        prefill_base_url: URLArg = None,
        decode_base_url: URLArg = None,
        on_trace: TraceCallback | None = None,
        on_prefill_failure: str = "decode",
        routing: str | RoutingPolicy | None = None,
        breaker: BreakerSettings | None = None,
        retries: RetrySettings | None = None,
        reuse_secret: str | None = None,
        base_url: str | httpx.URL | openai.NotGiven | None = openai.not_given,
        http_client: httpx.Client | httpx.AsyncClient | None = None,
        **kwargs: Any,
    ) -> None:
        settings = _settings_for(
            kwargs.pop("_pd_settings", None),
            http_client,
            self._transport_type,
            prefill_base_url=prefill_base_url,
            decode_base_url=decode_base_url,
            on_trace=on_trace,
            on_prefill_failure=on_prefill_failure,
            routing=routing,
            breaker=breaker,
            retries=retries,
            reuse_secret=reuse_secret,
        )
        base = _api_base(settings, base_url)
        wired = _wire(http_client, settings, self._transport_type, self._http_client_type, self._leg_transport_type)  # type: ignore[type-var]
        # openai 3.x annotates httpx2 clients but accepts httpx ones (it checks for both).
        super().__init__(base_url=base, http_client=wired, **kwargs)  # type: ignore[call-arg]
        self.pd_settings = settings

    def copy(
        self,
        *,
        prefill_base_url: URLArg = _UNSET,
        decode_base_url: URLArg = _UNSET,
        on_trace: TraceCallback | None = _UNSET,
        on_prefill_failure: str = _UNSET,
        routing: str | RoutingPolicy | None = _UNSET,
        breaker: BreakerSettings | None = _UNSET,
        retries: RetrySettings | None = _UNSET,
        reuse_secret: str | None = _UNSET,
        **kwargs: Any,
    ) -> Self:
        """The openai client's ``copy`` (and ``with_options``), keeping or overriding the P/D settings."""
        pd_options = {
            "prefill_base_url": prefill_base_url,
            "decode_base_url": decode_base_url,
            "on_trace": on_trace,
            "on_prefill_failure": on_prefill_failure,
            "routing": routing,
            "breaker": breaker,
            "retries": retries,
            "reuse_secret": reuse_secret,
        }
        copied: Self = super().copy(**_copy_arguments(self.pd_settings, pd_options, kwargs))  # type: ignore[misc]
        return copied

    with_options = copy


class PDChatClient(_PDClient, openai.OpenAI):
    """``openai.OpenAI`` for a prefill/decode disaggregated vLLM deployment.

    Chat and completions calls run a prefill call on ``prefill_base_url`` and a decode
    call (streamed or not) on ``decode_base_url``, forwarding the prefill's prompt token
    ids so the decode server does not render and tokenize the prompt again. Every other
    request goes to a decode endpoint. All other arguments are ``openai.OpenAI``'s.

    Args:
        prefill_base_url: a URL or list of URLs; default ``$PDCLIENT_PREFILL_BASE_URL``
            (comma-separated).
        decode_base_url: likewise, default ``$PDCLIENT_DECODE_BASE_URL``.
        on_trace: called with each call's ``PDTrace`` once the call is over.
        on_prefill_failure: when the prefill leg fails for good: ``"decode"`` (send the
            call to decode without P/D, the default), ``"fail"``, or a fallback base URL.
        routing: ``"least_outstanding"`` (default), ``"round_robin"``, ``"power_of_two"``,
            ``"affinity"``, or a ``RoutingPolicy`` object.
        breaker: circuit breaker settings per endpoint (``BreakerSettings``).
        retries: per-leg retry settings (``RetrySettings``).
        reuse_secret: signs each leg request (``X-PDClient-Signature``, spec v2) for servers
            running the server patch with ``PDCLIENT_REUSE_SECRET``; default that variable.
    """

    _transport_type = PDTransport
    _http_client_type = httpx.Client
    _leg_transport_type = httpx.HTTPTransport


class AsyncPDChatClient(_PDClient, openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` twin of ``PDChatClient``; same arguments."""

    _transport_type = AsyncPDTransport
    _http_client_type = httpx.AsyncClient
    _leg_transport_type = httpx.AsyncHTTPTransport
