"""``PDChatClient`` / ``AsyncPDChatClient``: openai clients whose HTTP client does P/D.

The clients are thin: they make the ``PDOptions``, build an httpx client around a
``PDTransport`` and hand everything else to ``openai.OpenAI`` unchanged. The handoff
lives in the transport and the call state (``transport._transport``, ``handoff._call``).
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Concatenate, ParamSpec, TypeVar

import httpx
import openai
from typing_extensions import Self

from ._errors import PDConfigError
from ._observe import PDObserver
from ._options import PDOptions
from .conversations import ConversationSettings
from .fleet import DiscoverySettings, Fleet, HealthSettings, ScrapeSettings
from .pools import BreakerSettings, RetrySettings, URLArg
from .routing import RoutingPolicy
from .transport import LEG_LIMITS, AsyncPDTransport, PDTransport

if TYPE_CHECKING:
    from ._trace import PDTrace

_NOT_GIVEN: Any = openai.NotGiven()
P = ParamSpec("P")
_C = TypeVar("_C")


def _arguments_of(
    source: Callable[Concatenate[Any, P], Any],
) -> Callable[[Callable[Concatenate[_C, ...], None]], Callable[Concatenate[_C, P], None]]:
    """``__init__`` with the keyword arguments of ``source`` (``copy``): one list of the P/D
    arguments, typed for the caller's checker and shown by ``inspect.signature``."""

    def takes(method: Callable[Concatenate[_C, ...], None]) -> Callable[Concatenate[_C, P], None]:
        method.__signature__ = inspect.signature(source).replace(return_annotation="None")  # type: ignore[attr-defined]
        return method

    return takes


def _given(arguments: dict[str, Any]) -> dict[str, Any]:
    """The PDOptions fields among a signature's arguments that the caller gave."""
    return {name: arguments[name] for name in PDOptions.names() if not isinstance(arguments[name], openai.NotGiven)}


class _PDClient:
    """The P/D part of both clients, written once: options, the wired httpx client, copy().

    Mixed in before ``openai.OpenAI`` / ``openai.AsyncOpenAI``; the twins only name
    their transport and httpx types.
    """

    _transport_type: ClassVar[type[PDTransport] | type[AsyncPDTransport]]
    _http_client_type: ClassVar[type[httpx.Client] | type[httpx.AsyncClient]]
    pd_options: PDOptions
    """The P/D options this client was made with (frozen); ``with_options(...)`` derives new ones."""

    def copy(
        self,
        /,
        *,
        options: PDOptions | None = None,
        prefill_base_url: URLArg | openai.NotGiven = _NOT_GIVEN,
        decode_base_url: URLArg | openai.NotGiven = _NOT_GIVEN,
        on_prefill_failure: str | openai.NotGiven = _NOT_GIVEN,
        allow_call_fallback_url: bool | openai.NotGiven = _NOT_GIVEN,
        allow_call_overrides: bool | openai.NotGiven = _NOT_GIVEN,
        routing: str | RoutingPolicy | openai.NotGiven = _NOT_GIVEN,
        breaker: BreakerSettings | openai.NotGiven = _NOT_GIVEN,
        retries: RetrySettings | openai.NotGiven = _NOT_GIVEN,
        reuse_secret: str | openai.NotGiven | None = _NOT_GIVEN,
        on_trace: Callable[[PDTrace], None] | openai.NotGiven | None = _NOT_GIVEN,
        observers: Sequence[PDObserver] | openai.NotGiven = _NOT_GIVEN,
        prefill_routing: str | RoutingPolicy | openai.NotGiven | None = _NOT_GIVEN,
        decode_routing: str | RoutingPolicy | openai.NotGiven | None = _NOT_GIVEN,
        load_signals: ScrapeSettings | bool | openai.NotGiven | None = _NOT_GIVEN,
        health_checks: HealthSettings | bool | openai.NotGiven | None = _NOT_GIVEN,
        discovery: DiscoverySettings | bool | openai.NotGiven | None = _NOT_GIVEN,
        kv_events: str | int | openai.NotGiven | None = _NOT_GIVEN,
        max_decode_migrations: int | openai.NotGiven = _NOT_GIVEN,
        migrate_non_streamed: bool | openai.NotGiven = _NOT_GIVEN,
        remote_prefill: str | openai.NotGiven = _NOT_GIVEN,
        dispatch: str | openai.NotGiven = _NOT_GIVEN,
        conversations: ConversationSettings | openai.NotGiven = _NOT_GIVEN,
        **kwargs: Any,
    ) -> Self:
        """The openai client's ``copy`` (and ``with_options``), keeping or changing the P/D options.

        Its keyword arguments are the constructor's too (``__init__`` takes them from here): the
        P/D options one by one or as ``options``, and the openai client's own."""
        given = _given(locals())
        new = (options or self.pd_options).replace(**given)
        if new.decode_urls != self.pd_options.decode_urls:
            kwargs.setdefault("base_url", new.decode_urls[0])  # copy() would keep the old decode URL
        extra = {**kwargs.pop("_extra_kwargs", {}), "options": new}
        copied: Self = super().copy(_extra_kwargs=extra, **kwargs)  # type: ignore[misc]
        return copied

    @_arguments_of(copy)
    def __init__(self, **kwargs: Any) -> None:
        options: PDOptions | None = kwargs.pop("options", None)
        base_url: object = kwargs.pop("base_url", _NOT_GIVEN)
        http_client: httpx.Client | httpx.AsyncClient | None = kwargs.pop("http_client", None)
        given = _given({name: kwargs.pop(name, _NOT_GIVEN) for name in PDOptions.names()})
        if options is not None and not isinstance(options, PDOptions):
            raise PDConfigError(f"options must be a PDOptions, got {type(options).__name__}")
        wired = self._wired_transport(http_client)
        if options is None and wired is not None:
            options = wired.options  # an http_client built on a P/D transport brings its options
        options = options.replace(**given) if options is not None else PDOptions(**given)
        if wired is None:
            transport: Any = self._transport_type(options=options)
            http_client = self._http_client_type(transport=transport, limits=LEG_LIMITS, follow_redirects=True)
        elif wired.options is not options:
            # A copy (with_options) with other P/D options: a new transport on the same connections.
            assert http_client is not None
            http_client = self._http_client_type(transport=wired.with_options(options), timeout=http_client.timeout)  # type: ignore[arg-type]
        _check_sdk_arguments(type(self).__name__, kwargs, super().__init__)
        # openai 3.x annotates httpx2 clients but accepts httpx ones (it checks for both).
        super().__init__(base_url=_api_base(options, base_url), http_client=http_client, **kwargs)  # type: ignore[call-arg]
        self.pd_options = options
        self._pd_transport: PDTransport | AsyncPDTransport = http_client._transport  # type: ignore[union-attr,assignment]

    @property
    def pd_fleet(self) -> Fleet:
        """The endpoint pools this client routes over (shared with its copies): health and load per endpoint."""
        return self._pd_transport.fleet

    def _wired_transport(self, http_client: object) -> PDTransport | AsyncPDTransport | None:
        if http_client is None:
            return None
        transport = getattr(http_client, "_transport", None)
        if not isinstance(http_client, self._http_client_type) or not isinstance(transport, self._transport_type):
            raise PDConfigError(
                f"http_client must be an {self._http_client_type.__name__}(transport="
                f"{self._transport_type.__name__}(...)), or left out; got {type(http_client).__name__} "
                f"with transport {type(transport).__name__}"
            )
        return transport

    with_options = copy


def _check_sdk_arguments(client: str, given: Mapping[str, Any], sdk_init: Callable[..., None]) -> None:
    """A misspelt argument is a PDConfigError naming it and what it may have meant, not the
    bare TypeError the SDK's constructor would raise."""
    accepted = inspect.signature(sdk_init).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        return
    unknown = [name for name in given if name not in accepted]
    if not unknown:
        return
    known = sorted({*PDOptions.names(), *(n for n in accepted if not n.startswith("_")), "options", "http_client"})
    name = unknown[0]
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise PDConfigError(f"{client} got an unknown argument {name!r}{hint} Known: {', '.join(known)}")


def _api_base(options: PDOptions, base_url: object) -> str:
    """The SDK's base URL: a decode URL, since every non-P/D request goes to decode."""
    if base_url is None or isinstance(base_url, openai.NotGiven):
        return options.decode_urls[0]
    given = str(base_url).rstrip("/")
    if given not in options.decode_urls:
        raise PDConfigError(
            f"base_url {given!r} is not one of decode_base_url {list(options.decode_urls)}; "
            "a P/D client sends to decode_base_url, so leave base_url out"
        )
    return given


class PDChatClient(_PDClient, openai.OpenAI):
    """``openai.OpenAI`` for a prefill/decode disaggregated vLLM deployment.

    Chat and completions calls run a prefill call on ``prefill_base_url`` and a decode
    call (streamed or not) on ``decode_base_url``, forwarding the prefill's prompt token
    ids so the decode server does not render and tokenize the prompt again. Every other
    request goes to a decode endpoint. All other arguments are ``openai.OpenAI``'s.

    The P/D arguments are the fields of ``PDOptions`` (see there); pass them one by one,
    or as ``options=PDOptions(...)`` (arguments given beside it override its fields).
    """

    _transport_type = PDTransport
    _http_client_type = httpx.Client


class AsyncPDChatClient(_PDClient, openai.AsyncOpenAI):
    """``openai.AsyncOpenAI`` twin of ``PDChatClient``; same arguments."""

    _transport_type = AsyncPDTransport
    _http_client_type = httpx.AsyncClient
