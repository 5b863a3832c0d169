"""``PDTransport`` / ``AsyncPDTransport``: the P/D handoff at httpx's transport seam.

They receive the plain HTTP request the openai SDK built for its base URL (a decode
endpoint). POST ``/chat/completions`` and ``/completions`` become a prefill leg and a
decode leg; every other request goes to a decode endpoint as it is. The decode response,
streamed or not, is handed back to the SDK as it arrives, so ``Stream``,
``with_raw_response`` and ``with_streaming_response`` work.

Every decision is the ``Call``'s (``handoff._call``); the transports only send legs, read
bodies and drive the retries, and the two differ only by ``await``.
"""

from __future__ import annotations

import asyncio
from typing import ClassVar

import anyio
import httpx
from typing_extensions import Self

from .._errors import PDConfigError
from .._observe import Observers, TraceCallback
from .._options import PDOptions
from ..fleet import Fleet, running_library
from ..handoff import PREFILL_FAILURES, Call, CallContext, HandoffInstead, Leg, dispatch, release_request
from ..pools import AllEndpointsOpen, URLArg, retry
from ..wire import Refusal
from ._concurrent import AsyncDecodeInFlight, DecodeInFlight
from ._leg_client import AsyncLegClient, LegClient
from ._migrating_stream import AsyncLegIO, LegIO, async_decode_stream, decode_stream


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


class _TransportBase:
    """What the two transports share besides sending: their options, their fleet, a copy's context."""

    _context: CallContext
    _legs: LegClient | AsyncLegClient
    _asynchronous: ClassVar[bool]
    """Whether the transport serves an async client: its fleet's background work is then a task."""

    @property
    def options(self) -> PDOptions:
        return self._context.options

    @property
    def fleet(self) -> Fleet:
        """The endpoint pools this transport routes over: health and load per endpoint."""
        return self._context.fleet

    def _derived_context(self, options: PDOptions) -> CallContext:
        """A ``with_options`` copy's context: ``options``, on this fleet if it still fits them."""
        return _context(options, self._context.fleet, asynchronous=self._asynchronous)


class PDTransport(_TransportBase, httpx.BaseTransport):
    """httpx transport that splits chat and completions calls into prefill and decode legs.

    Use it with any openai client whose ``base_url`` is one of the decode URLs::

        transport = PDTransport(prefill_base_url="http://p:8100/v1", decode_base_url="http://d:8200/v1")
        client = openai.OpenAI(base_url="http://d:8200/v1", api_key="-", http_client=httpx.Client(transport=transport))

    ``options`` holds every other setting (``PDOptions``); the URL arguments override
    its URLs. ``leg_transport`` sends the legs (default: a pooled ``httpx.HTTPTransport``,
    honouring ``HTTP(S)_PROXY`` / ``NO_PROXY`` as httpx does).
    """

    _legs: LegClient
    _asynchronous = False

    def __init__(
        self,
        prefill_base_url: URLArg = None,
        decode_base_url: URLArg = None,
        *,
        options: PDOptions | None = None,
        leg_transport: httpx.BaseTransport | None = None,
    ) -> None:
        self._setup(
            _context(_resolve(prefill_base_url, decode_base_url, options), None, asynchronous=False),
            LegClient(leg_transport),
        )

    def _setup(self, context: CallContext, legs: LegClient) -> None:
        """Every attribute a transport has, set here for the constructor and ``with_options``
        alike: a copy that skipped one would fail only when a call reached for it."""
        self._context = context
        self._legs = legs

    def with_options(self, options: PDOptions) -> Self:
        """A transport with other options, sharing this one's connections (and its fleet, if it still fits)."""
        derived = object.__new__(type(self))
        derived._setup(self._derived_context(options), self._legs)
        return derived

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        self._context.fleet.start()
        call = Call(self._context, request)
        try:
            if call.kind is None:
                return self._pass_through(call)
            request.read()
            ended = call.plan_or_refuse()
            if ended is None and call.wants_prefill():
                sent = dispatch.concurrent_decode(call)
                if sent is not None:
                    return self._concurrent(call, sent)
                ended = self._prefill(call)
            return ended or self._decode(call)
        except BaseException as exc:
            call.abandoned(exc)
            raise

    def _pass_through(self, call: Call) -> httpx.Response:
        if call.streams_upload:
            refused = call.check_upload()
        else:
            call.request.read()
            refused = call.check_pass_through()
        return refused or self._decode(call)

    def _prefill(self, call: Call) -> httpx.Response | None:
        if not call.decode_admitted():
            return call.decode_outage()
        try:
            return retry.run(call.prefill_retrying(), self._prefill_attempt, call)
        except PREFILL_FAILURES as exc:
            return call.prefill_failed(exc)

    def _concurrent(self, call: Call, sent: dispatch.ConcurrentDecode) -> httpx.Response:
        """Both legs at once (``handoff._dispatch``): the decode in a thread, the prefill here."""
        decode = DecodeInFlight(self._legs.fresh_connections(), sent.request, call)
        answered = False
        try:
            ended = self._prefill(call)
            why = dispatch.moved_on(call, sent) if ended is None else "the prefill failed"
            if why is None:
                response = decode.result()
                why = decode.failure(response)
                if why is None and response is not None:
                    answered = True
                    why = decode.check_prompt(response, sent)
                    if why is None:
                        leg_io = LegIO(self._read, self._open_decode, self._send_release)
                        return call.decode_response(response, decode_stream(response, call, leg_io))
        except BaseException:
            # Whatever ends the call here (a Ctrl-C while the decode's headers are awaited
            # too) cuts the decode: left running, it would generate its answer for nobody.
            decode.cancel()
            raise
        decode.cancel()
        if ended is not None:
            return ended
        dispatch.fall_back(call, why or "the decode gave no answer", kv_spent=answered)
        return self._decode(call)

    def _prefill_attempt(self, call: Call) -> httpx.Response | None:
        request = call.prefill_request()
        try:
            response = self._read(request)
        except BaseException as exc:
            call.prefill.end(None, exc)
            raise
        return call.check_prefill(response)

    def _decode(self, call: Call) -> httpx.Response:
        try:
            response = self._open_decode(call)
        except HandoffInstead:
            return self._prefill(call) or self._decode(call)
        except AllEndpointsOpen as exc:
            self._release(call)
            return call.decode_unavailable(exc)
        except Refusal as exc:  # an upload refused as it streamed: it never reached its server whole
            return call.refuse(str(exc))
        except BaseException:
            self._release(call)
            raise
        try:
            legs = LegIO(self._read, self._open_decode, self._send_release)
            return call.decode_response(response, decode_stream(response, call, legs))
        except BaseException:
            response.close()
            raise

    def _open_decode(self, call: Call) -> httpx.Response:
        return retry.run(retry.decode_policy(self._context.options.retries), self._decode_attempt, call)

    def _decode_attempt(self, call: Call) -> httpx.Response:
        request = call.decode_request()
        request.extensions["trace"] = lambda event, info: call.decode_event(event)
        try:
            return self._legs.send(request)
        except BaseException as exc:
            call.decode_attempt_failed(exc)
            raise

    def _release(self, call: Call) -> None:
        """The handoff was abandoned between the legs: free the prefill's KV blocks now,
        before the exception goes on (a background thread would die with the process)."""
        self._send_release(release_request(call))

    def _send_release(self, pending: tuple[Leg, httpx.Request] | None) -> None:
        """Send a KV release leg (``handoff.release_request``, or a moved stream's), if there is one."""
        if pending is None:
            return
        leg, request = pending
        try:
            response = self._read(request)
            leg.end(response.status_code, None)
        except Exception as exc:
            leg.end(None, exc)

    def _read(self, request: httpx.Request) -> httpx.Response:
        """A leg's response, its body read and its connection back in the pool."""
        response = self._legs.send(request)
        try:
            response.read()
        finally:
            response.close()
        return response

    def close(self) -> None:
        self._context.fleet.close()
        self._legs.close()


class AsyncPDTransport(_TransportBase, httpx.AsyncBaseTransport):
    """Async twin of ``PDTransport`` (asyncio and trio)."""

    _legs: AsyncLegClient
    _asynchronous = True

    def __init__(
        self,
        prefill_base_url: URLArg = None,
        decode_base_url: URLArg = None,
        *,
        options: PDOptions | None = None,
        leg_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._setup(
            _context(_resolve(prefill_base_url, decode_base_url, options), None, asynchronous=True),
            AsyncLegClient(leg_transport),
            set(),
        )

    def _setup(
        self, context: CallContext, legs: AsyncLegClient, outliving: set[asyncio.Future[httpx.Response]]
    ) -> None:
        """Async twin of ``PDTransport._setup``."""
        self._context = context
        self._legs = legs
        self._outliving = outliving
        """Concurrent calls' prefills whose callers left before they answered (``_read_to_the_end``),
        on ``_legs``' connections: shared with the copies, as the connections are, so whichever
        closes them first waits for every such prefill."""

    def with_options(self, options: PDOptions) -> Self:
        """A transport with other options, sharing this one's connections (and its fleet, if it still fits)."""
        derived = object.__new__(type(self))
        derived._setup(self._derived_context(options), self._legs, self._outliving)
        return derived

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self._context.fleet.start()
        call = Call(self._context, request)
        try:
            if call.kind is None:
                return await self._pass_through(call)
            await request.aread()
            ended = call.plan_or_refuse()
            if ended is None and call.wants_prefill():
                sent = dispatch.concurrent_decode(call)
                if sent is not None:
                    return await self._concurrent(call, sent)
                ended = await self._prefill(call)
            return ended or await self._decode(call)
        except BaseException as exc:
            call.abandoned(exc)
            raise

    async def _pass_through(self, call: Call) -> httpx.Response:
        if call.streams_upload:
            refused = call.check_upload()
        else:
            await call.request.aread()
            refused = call.check_pass_through()
        return refused or await self._decode(call)

    async def _prefill(self, call: Call) -> httpx.Response | None:
        if not call.decode_admitted():
            return call.decode_outage()
        try:
            return await retry.run_async(call.prefill_retrying(), self._prefill_attempt, call)
        except PREFILL_FAILURES as exc:
            return call.prefill_failed(exc)

    async def _concurrent(self, call: Call, sent: dispatch.ConcurrentDecode) -> httpx.Response:
        """Async twin of ``PDTransport._concurrent``: the decode in a task, the prefill here."""
        decode = AsyncDecodeInFlight(self._legs, sent.request, call)
        answered = False
        try:
            async with anyio.create_task_group() as legs:
                legs.start_soon(decode.run)
                try:
                    ended = await self._prefill(call)
                    why = dispatch.moved_on(call, sent) if ended is None else "the prefill failed"
                except BaseException:
                    decode.cancel()
                    raise
                if why is not None:
                    decode.cancel()
            if why is None:
                response = decode.result()
                why = decode.failure(response)
                if why is None and response is not None:
                    answered = True
                    why = await decode.check_prompt(response, sent)
                    if why is None:
                        leg_io = AsyncLegIO(self._read, self._open_decode, self._send_release)
                        return call.decode_response(response, async_decode_stream(response, call, leg_io))
        except BaseException:
            decode.cancel()
            await decode.discard()
            raise
        decode.cancel()
        await decode.discard()
        if ended is not None:
            return ended
        dispatch.fall_back(call, why or "the decode gave no answer", kv_spent=answered)
        return await self._decode(call)

    async def _prefill_attempt(self, call: Call) -> httpx.Response | None:
        request = call.prefill_request()
        concurrent = call.dispatch == dispatch.CONCURRENT
        try:
            response = await (self._read_to_the_end(request) if concurrent else self._read(request))
        except BaseException as exc:
            call.prefill.end(None, exc)
            raise
        return call.check_prefill(response)

    async def _read_to_the_end(self, request: httpx.Request) -> httpx.Response:
        """A concurrent call's prefill, read to its end even if the caller leaves meanwhile.

        The decode sent with it has registered its blocks with the prefill server, and vLLM
        0.32 frees the blocks of an aborted push-mode decode only once a WRITE lands (vLLM
        issue #46283): a prefill cut with its caller would leave them held for good. So the
        caller's cancel ends the decode and returns at once, and the prefill goes on in a
        task of its own until its server answers; its WRITE then frees the decode's blocks.
        Under trio no task outlives its caller's nursery: the prefill is read as any leg.
        """
        if running_library() != "asyncio":
            return await self._read(request)
        task = asyncio.ensure_future(self._read(request))
        self._outliving.add(task)
        task.add_done_callback(self._outlived)
        return await asyncio.shield(task)

    def _outlived(self, task: asyncio.Future[httpx.Response]) -> None:
        self._outliving.discard(task)
        if not task.cancelled():
            task.exception()  # its caller, if it left, no longer reads it: retrieved here

    async def _decode(self, call: Call) -> httpx.Response:
        try:
            response = await self._open_decode(call)
        except HandoffInstead:
            return await self._prefill(call) or await self._decode(call)
        except AllEndpointsOpen as exc:
            await self._release(call)
            return call.decode_unavailable(exc)
        except Refusal as exc:  # an upload refused as it streamed: it never reached its server whole
            return call.refuse(str(exc))
        except BaseException:
            await self._release(call)
            raise
        try:
            legs = AsyncLegIO(self._read, self._open_decode, self._send_release)
            return call.decode_response(response, async_decode_stream(response, call, legs))
        except BaseException:
            await response.aclose()
            raise

    async def _open_decode(self, call: Call) -> httpx.Response:
        return await retry.run_async(retry.decode_policy(self._context.options.retries), self._decode_attempt, call)

    async def _decode_attempt(self, call: Call) -> httpx.Response:
        request = call.decode_request()

        async def watch(event: str, info: object) -> None:
            call.decode_event(event)

        request.extensions["trace"] = watch
        try:
            return await self._legs.send(request)
        except BaseException as exc:
            call.decode_attempt_failed(exc)
            raise

    async def _release(self, call: Call) -> None:
        """Async twin of ``PDTransport._release``."""
        await self._send_release(release_request(call))

    async def _send_release(self, pending: tuple[Leg, httpx.Request] | None) -> None:
        """Async twin of ``PDTransport._send_release``: shielded, so a cancelled caller still sends it."""
        if pending is None:
            return
        leg, request = pending
        with anyio.CancelScope(shield=True):
            try:
                response = await self._read(request)
                leg.end(response.status_code, None)
            except Exception as exc:
                leg.end(None, exc)

    async def _read(self, request: httpx.Request) -> httpx.Response:
        response = await self._legs.send(request)
        try:
            await response.aread()
        finally:
            await response.aclose()
        return response

    async def aclose(self) -> None:
        if self._outliving:
            # Closing the legs' connections would abort them, and with them the WRITE that
            # frees their decodes' blocks: they get the prefill phase's time to answer.
            await asyncio.wait(set(self._outliving), timeout=self._context.options.retries.prefill_timeout)
        await self._context.fleet.aclose()
        await self._legs.aclose()


__all__ = ["AsyncPDTransport", "PDTransport"]
