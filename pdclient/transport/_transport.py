"""``PDTransport`` / ``AsyncPDTransport``: the P/D handoff at httpx's transport seam.

They receive the plain HTTP request the openai SDK built for its base URL (a decode
endpoint). POST ``/chat/completions`` and ``/completions`` become a prefill leg and a
decode leg; every other request goes to a decode endpoint as it is. The decode response,
streamed or not, is handed back to the SDK as it arrives, so ``Stream``,
``with_raw_response`` and ``with_streaming_response`` work.

Every decision is the call's flow's (``handoff.call_flow``); each transport is its driver
(``_drivers``): it runs the flow's steps, blocking or with ``await``, and decides nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, TypeVar

import httpx
from typing_extensions import Self

from .._errors import PDConfigError
from .._observe import Observers, TraceCallback
from .._options import PDOptions
from ..fleet import Fleet
from ..handoff import Call, CallContext, call_flow
from ..pools import URLArg
from ._drivers import AsyncDriver, SyncDriver
from ._leg_client import AsyncLegClient, LegClient

LT = TypeVar("LT", httpx.BaseTransport, httpx.AsyncBaseTransport)
D = TypeVar("D", SyncDriver, AsyncDriver)


def _resolve(prefill_base_url: URLArg, decode_base_url: URLArg, options: PDOptions | None) -> PDOptions:
    if options is not None and not isinstance(options, PDOptions):
        raise PDConfigError(f"options must be a PDOptions, got {type(options).__name__}")
    if options is None:
        return PDOptions(prefill_base_url=prefill_base_url, decode_base_url=decode_base_url)
    urls = {"prefill_base_url": prefill_base_url, "decode_base_url": decode_base_url}
    return options.replace(**{name: url for name, url in urls.items() if url is not None})


def _context(options: PDOptions, fleet: Fleet | None, *, asynchronous: bool) -> CallContext:
    observers = list(options.observers)
    if options.on_trace is not None:
        observers.append(TraceCallback(options.on_trace))
    if fleet is None or not fleet.serves(options):
        fleet = Fleet(options, asynchronous=asynchronous)
    return CallContext(options=options, fleet=fleet, observers=Observers(observers))


class _TransportBase(Generic[LT, D]):
    """What the two transports share besides their driver's kind: how they are built, their
    options, their fleet, a copy."""

    _driver: D
    _asynchronous: ClassVar[bool]
    """Whether the transport serves an async client: its fleet's background work is then a task."""
    _kinds: ClassVar[tuple[type[Any], type[Any]]]
    """The driver's class and its leg client's."""

    def __init__(
        self,
        prefill_base_url: URLArg = None,
        decode_base_url: URLArg = None,
        *,
        options: PDOptions | None = None,
        leg_transport: LT | None = None,
    ) -> None:
        options = _resolve(prefill_base_url, decode_base_url, options)
        self._context = _context(options, None, asynchronous=self._asynchronous)
        driver, legs = self._kinds
        self._driver = driver(legs(leg_transport))

    @property
    def options(self) -> PDOptions:
        return self._context.options

    @property
    def fleet(self) -> Fleet:
        """The endpoint pools this transport routes over: health and load per endpoint."""
        return self._context.fleet

    @property
    def _legs(self) -> LegClient | AsyncLegClient:
        return self._driver.legs

    def with_options(self, options: PDOptions) -> Self:
        """A transport with other options, sharing this one's driver (its connections, and the
        prefills outliving their callers on them) and its fleet, if it still fits them."""
        derived = object.__new__(type(self))
        derived.__dict__.update(self.__dict__)  # every attribute, the driver included: shared
        derived._context = _context(options, self._context.fleet, asynchronous=self._asynchronous)
        return derived


class PDTransport(_TransportBase[httpx.BaseTransport, SyncDriver], httpx.BaseTransport):
    """httpx transport that splits chat and completions calls into prefill and decode legs.

    Use it with any openai client whose ``base_url`` is one of the decode URLs::

        transport = PDTransport(prefill_base_url="http://p:8100/v1", decode_base_url="http://d:8200/v1")
        client = openai.OpenAI(base_url="http://d:8200/v1", api_key="-", http_client=httpx.Client(transport=transport))

    ``options`` holds every other setting (``PDOptions``); the URL arguments override
    its URLs. ``leg_transport`` sends the legs (default: a pooled ``httpx.HTTPTransport``,
    honouring ``HTTP(S)_PROXY`` / ``NO_PROXY`` as httpx does).
    """

    _asynchronous = False
    _kinds = SyncDriver, LegClient

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self._context.fleet.start()
        return self._driver.drive(call_flow(Call(self._context, request)))

    def close(self) -> None:
        self._context.fleet.close()
        self._driver.legs.close()


class AsyncPDTransport(_TransportBase[httpx.AsyncBaseTransport, AsyncDriver], httpx.AsyncBaseTransport):
    """Async twin of ``PDTransport`` (asyncio and trio)."""

    _asynchronous = True
    _kinds = AsyncDriver, AsyncLegClient

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self._context.fleet.start()
        return await self._driver.drive(call_flow(Call(self._context, request)))

    async def aclose(self) -> None:
        await self._driver.outliving.wait(self._context.options.retries.prefill_timeout)
        await self._context.fleet.aclose()
        await self._driver.legs.aclose()


__all__ = ["AsyncPDTransport", "PDTransport"]
