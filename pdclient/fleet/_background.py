"""Background work for endpoint pools: load scrapes, health probes, DNS re-resolution, prefill warm-ups.

Each kind of work is a sans-I/O *core*: plain state that says what to do next and takes
the result, without doing any I/O itself::

    core.due(now)                 -> [Job]     what to fetch or look up now
    core.next_due()               -> float     when it next wants to run (clock time)
    core.apply(job, outcome, now)              what came back (Fetched or LookedUp)

so the cores are unit-tested with a fake clock and hand-made outcomes. One loop runs them
(``_Driver._serve``, on anyio with one HTTP client: an ``httpx.AsyncClient``, or the
proxy's legs' transport, ``TransportClient``): every due job is a task
of its own whose outcome is applied the moment it ends, so a server that hangs or drips
its answer holds up only its own job, never the other members' probes or scrapes. A
fetch has a deadline for the whole exchange, its body included (``Fetch.timeout``):
httpx's timeouts bound each network read, and a body sent one byte per read would
otherwise never time out. Two drivers host that loop:

- ``BackgroundThread``: sync clients. One daemon thread running an event loop of its own,
  so a sync program gets the same concurrency and deadlines without a loop of its own.
- ``BackgroundTask``: async clients. One task of the running loop, started on first use:
  an asyncio task, or under trio a system task of the run (it ends with the run).

``Background`` is one fleet's work (``fleet._fleet.Fleet.background``): its cores and the
driver that runs them, chosen on first use: a task when an async client's first call
comes from a running event loop (asyncio or trio), else a thread. Nothing here starts by
itself: a ``Background`` exists only when a feature that needs one is on, its driver
starts on the client's first call and stops on ``close()`` / ``aclose()`` (or when the
fleet is garbage-collected unclosed).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import sys
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import anyio
import anyio.to_thread
import httpx

from .._errors import PDConfigError

logger = logging.getLogger("pdclient")


def check_count(owner: str, name: str, value: object) -> None:
    """A settings field must be an int >= 1: else a ``PDConfigError`` naming it (durations:
    ``pdclient._durations.check_seconds``)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PDConfigError(f"{owner}.{name} must be an int > 0, got {value!r}")


@dataclass(frozen=True)
class Fetch:
    """A GET to make, or a POST of ``content`` when it is given."""

    url: str
    timeout: float
    """Seconds the whole exchange may take, from connecting to the answer's last byte."""
    host: str | None = None
    """The DNS name to present (Host header, TLS SNI) when ``url`` holds an address."""
    content: bytes | None = None
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Lookup:
    """A DNS lookup to make: the addresses of ``host`` for ``port``."""

    host: str
    port: int


@dataclass(frozen=True)
class Job:
    key: object
    """The core's own tag for the job (an endpoint, a base URL)."""
    action: Fetch | Lookup


@dataclass(frozen=True)
class Fetched:
    """What a Fetch got: a status and body, or the transport error instead."""

    status: int | None
    text: str = ""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300


@dataclass(frozen=True)
class LookedUp:
    """What a Lookup got: the addresses in the resolver's order, or the error instead."""

    addresses: tuple[str, ...] = ()
    error: str | None = None


JobResult = Fetched | LookedUp
Resolver = Callable[[str, int], Sequence[str]]
"""``resolver(host, port)`` -> the host's addresses; tests pass their own (several 127.0.0.x)."""


class Core(Protocol):
    def due(self, now: float) -> list[Job]: ...
    def next_due(self) -> float: ...
    def apply(self, job: Job, outcome: JobResult, now: float) -> None: ...


M = TypeVar("M")


class EveryMember(Generic[M]):
    """A schedule for cores that visit every member of a pool every ``interval`` seconds.

    ``members`` is read each time, so a member that discovery adds is due at once and a
    removed one is no longer visited (its entry goes with the object: weak references).
    A member is not due again while its last job is out.
    """

    def __init__(self, members: Callable[[], Sequence[M]], interval: float) -> None:
        self.members = members
        self.interval = interval
        self._next: weakref.WeakKeyDictionary[M, float] = weakref.WeakKeyDictionary()
        self._out: weakref.WeakSet[M] = weakref.WeakSet()

    def due(self, now: float) -> list[M]:
        due = [m for m in self.members() if m not in self._out and self._next.get(m, 0.0) <= now]
        for member in due:
            self._out.add(member)
            self._next[member] = now + self.interval
        return due

    def done(self, member: M) -> None:
        self._out.discard(member)

    def next_due(self) -> float:
        return min((self._next.get(m, 0.0) for m in self.members() if m not in self._out), default=float("inf"))


def system_resolver(host: str, port: int) -> list[str]:
    """The addresses ``getaddrinfo`` gives for a TCP connection, de-duplicated, in its order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def host_header(url: httpx.URL, name: str) -> str:
    """The Host header for ``url`` when it holds an address that stands for ``name``."""
    return name if url.port is None else f"{name}:{url.port}"


def _fetch_args(action: Fetch) -> dict[str, object]:
    args: dict[str, object] = {"method": "GET" if action.content is None else "POST", "url": action.url}
    args["timeout"] = action.timeout
    args["content"] = action.content
    headers = dict(action.headers)
    if action.host is not None:
        url = httpx.URL(action.url)
        headers["host"] = host_header(url, action.host)
        args["extensions"] = {"sni_hostname": action.host} if url.scheme == "https" else {}
    args["headers"] = headers
    return args


class TransportClient:
    """What a driver asks of its ``httpx.AsyncClient`` (``stream``, and closing), done straight
    on another client's transport (the proxy's legs' aiohttp), which stays open for its owner.

    The client's own handling of a request and its answer (default headers, cookies, hooks,
    the response's bookkeeping) is nothing a background fetch needs, and it cost a warm-up
    about as much CPU again as the transport's own work (~1.4 against ~0.6 ms a warm-up
    through the legs' aiohttp, measured on the Zen 3 EPYC). The transport honours the
    environment's proxies itself."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self._transport = transport

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        *,
        timeout: float,  # noqa: ASYNC109 (httpx.AsyncClient.stream's: per-read timeouts for the transport)
        content: bytes | None = None,
        headers: dict[str, str] | None = None,
        extensions: dict[str, object] | None = None,
    ) -> AsyncIterator[httpx.Response]:
        timeouts = {"timeout": httpx.Timeout(timeout).as_dict()}
        request = httpx.Request(
            method, url, content=content, headers=headers, extensions={**(extensions or {}), **timeouts}
        )
        response = await self._transport.handle_async_request(request)
        response.request = request
        try:
            yield response
        finally:
            await response.aclose()

    async def __aenter__(self) -> TransportClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        """Nothing: the transport is its owner's to close."""


HTTPClient = httpx.AsyncClient | TransportClient
"""What a driver fetches with: a client of its own, or the proxy's legs' transport."""


MAX_ANSWER_BYTES = 16 * 1024 * 1024
"""A longer answer to a background fetch is a failure, not read on (a vLLM ``/metrics`` is tens of kB)."""


async def fetch(http: HTTPClient, action: Fetch) -> Fetched:
    """``action``'s status and body, or its error; within ``action.timeout`` from the
    connection to the body's last byte: a server that drips its answer fails at the
    deadline as one that never answers does."""
    with anyio.move_on_after(action.timeout):
        return await _fetch(http, action)
    return Fetched(None, error=f"TimeoutError: no whole answer within {action.timeout:g} s")


async def _fetch(http: HTTPClient, action: Fetch) -> Fetched:
    try:
        async with http.stream(**_fetch_args(action)) as response:  # type: ignore[arg-type]
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > MAX_ANSWER_BYTES:
                    return Fetched(None, error=f"answer longer than {MAX_ANSWER_BYTES} bytes")
    except httpx.HTTPError as exc:
        return Fetched(None, error=f"{type(exc).__name__}: {exc}")
    return Fetched(response.status_code, body.decode(response.encoding or "utf-8", "replace"))


def lookup_sync(resolver: Resolver, action: Lookup) -> LookedUp:
    try:
        return LookedUp(tuple(resolver(action.host, action.port)))
    except (OSError, UnicodeError) as exc:
        return LookedUp(error=f"{type(exc).__name__}: {exc}")


async def lookup_async(resolver: Resolver, action: Lookup) -> LookedUp:
    # getaddrinfo blocks: off the event loop, as asyncio's own loop.getaddrinfo does; a
    # lookup stuck in the resolver is left to its thread when the driver stops.
    return await anyio.to_thread.run_sync(lookup_sync, resolver, action, abandon_on_cancel=True)


class _Driver:
    """The loop both drivers run: asking the cores for work, running each job, handing back results."""

    def __init__(
        self,
        cores: Sequence[Core],
        *,
        resolver: Resolver = system_resolver,
        clock: Callable[[], float] = time.monotonic,
        http: Callable[[], HTTPClient] = httpx.AsyncClient,
        max_sleep: float = 1.0,
        name: str = "pdclient-background",
    ) -> None:
        self.cores = tuple(cores)
        self.name = name
        self._resolver = resolver
        self._clock = clock
        self._http = http
        self._max_sleep = max_sleep
        self._init_state()

    def _init_state(self) -> None:
        """Each driver's own state (its thread or task), set up with the loop's."""

    def _due(self) -> list[tuple[Core, Job]]:
        now = self._clock()
        jobs: list[tuple[Core, Job]] = []
        for core in self.cores:
            try:
                jobs += [(core, job) for job in core.due(now)]
            except Exception:  # a bug in one core must not stop the others
                logger.exception("pdclient background: %r failed to plan its work", core)
        return jobs

    def _apply(self, core: Core, job: Job, outcome: JobResult) -> None:
        try:
            core.apply(job, outcome, self._clock())
        except Exception:
            logger.exception("pdclient background: %r failed to apply %r", core, outcome)

    @staticmethod
    def _failed(action: Fetch | Lookup, exc: BaseException) -> JobResult:
        logger.debug("pdclient background: %r raised", action, exc_info=exc)
        error = f"{type(exc).__name__}: {exc}"
        return LookedUp(error=error) if isinstance(action, Lookup) else Fetched(None, error=error)

    def _sleep_seconds(self) -> float:
        wake = min((core.next_due() for core in self.cores), default=float("inf"))
        return min(self._max_sleep, max(0.0, wake - self._clock()))

    async def _serve(self, stopped: Callable[[], bool], wake: Wake) -> None:
        """Start every due job as a task of its own, then sleep until the next is due, a job
        ends or ``wake`` is set; until ``stopped()``. The jobs still out are cancelled then."""
        async with self._http() as http, anyio.create_task_group() as jobs:  # jobs end before the client
            while not stopped():
                wake.clear()  # before asking: work added from now on wakes the wait below
                for core, job in self._due():
                    jobs.start_soon(self._job, http, core, job, wake)
                await wake.wait(self._sleep_seconds())
            jobs.cancel_scope.cancel()

    async def _job(self, http: HTTPClient, core: Core, job: Job, wake: Wake) -> None:
        self._apply(core, job, await self._perform(http, job.action))
        wake.set()  # its member may be due again: the loop plans its sleep anew

    async def _perform(self, http: HTTPClient, action: Fetch | Lookup) -> JobResult:
        try:
            if isinstance(action, Lookup):
                return await lookup_async(self._resolver, action)
            return await fetch(http, action)
        except Exception as exc:  # whatever a job raises is its outcome, never the loop's end
            return self._failed(action, exc)


def running_library() -> str | None:
    """``"asyncio"`` or ``"trio"`` when called from a running event loop of theirs, else None
    (as anyio tells them apart, without sniffio: anyio no longer depends on it)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return "asyncio"
    trio = sys.modules.get("trio")
    if trio is not None:
        try:
            trio.lowlevel.current_trio_token()
        except RuntimeError:
            return None
        return "trio"
    return None


class EventLoop:
    """The running event loop (asyncio's or trio's), as the one thing the drivers need of it:
    running a callback on it from any thread, soon, without waiting."""

    __slots__ = ("_call_soon", "_thread", "token")

    def __init__(self) -> None:
        if running_library() == "trio":
            token: object = sys.modules["trio"].lowlevel.current_trio_token()
            self._call_soon: Callable[[Callable[[], object]], object] = token.run_sync_soon  # type: ignore[attr-defined]
        else:
            token = asyncio.get_running_loop()
            self._call_soon = token.call_soon_threadsafe
        self.token = token
        """Which loop it is (a loop that ended is never the running one again)."""
        self._thread = threading.get_ident()

    def is_current(self) -> bool:
        """Whether the caller runs on this loop."""
        try:
            return EventLoop().token is self.token
        except RuntimeError:
            return False

    def call_soon(self, callback: Callable[[], object]) -> None:
        """``callback`` on this loop: now when called from it, else queued (nothing if the loop ended)."""
        if threading.get_ident() == self._thread and self.is_current():
            callback()
            return
        with contextlib.suppress(RuntimeError):  # asyncio's loop closed, trio's run over
            self._call_soon(callback)


class Wake:
    """An event the driver sleeps on, set from any thread (a job queued, the driver stopped)
    and cleared by the loop before it asks its cores for work: an event anew per sleep
    (asyncio's on an asyncio loop, else anyio's)."""

    __slots__ = ("_event", "loop")

    def __init__(self) -> None:
        self.loop = EventLoop()
        self._event = self._new_event()

    def _new_event(self) -> asyncio.Event | anyio.Event:
        return asyncio.Event() if isinstance(self.loop.token, asyncio.AbstractEventLoop) else anyio.Event()

    def set(self) -> None:
        self.loop.call_soon(self._event.set)

    def clear(self) -> None:
        if self._event.is_set():
            self._event = self._new_event()

    async def wait(self, seconds: float) -> None:
        """Until the event is set or ``seconds`` have passed.

        On asyncio, a timer sets the event at the deadline. An anyio timeout that expires
        delivers a cancellation through the waiting task: ~0.15-0.5 ms of CPU a sleep on
        the CPU pair's AMD EPYC, against ~10 us for the timer (measured). A driver with
        nothing due sleeps out its ``max_sleep`` once a second, so that was most of what
        ``auto``'s warm-up driver cost an idle proxy.
        """
        event = self._event
        if isinstance(event, asyncio.Event):
            timer = asyncio.get_running_loop().call_later(seconds, event.set)
            try:
                await event.wait()
            finally:
                timer.cancel()
            return
        with anyio.move_on_after(seconds):
            await event.wait()


class BackgroundThread(_Driver):
    """Runs the cores in one daemon thread, on an event loop of its own (sync clients)."""

    def _init_state(self) -> None:
        self._stop = threading.Event()
        self._wake: Wake | None = None
        """The thread's wake event (on its loop), once the loop runs."""
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Start the thread unless it runs already (idempotent, thread-safe)."""
        with self._lock:
            if self.running:
                return
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, args=(self._stop,), name=self.name, daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Ask the cores for work now, not at the end of the current sleep (from any thread)."""
        awake = self._wake
        if awake is not None:
            awake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and wait for it (the jobs in progress are cancelled)."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
            awake, self._wake = self._wake, None
        if awake is not None:
            awake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _run(self, stop: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(stop))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            # Not asyncio.run: it would wait for a lookup stuck in the resolver (a worker thread).
            loop.close()

    async def _main(self, stop: threading.Event) -> None:
        wake = Wake()
        with self._lock:
            if stop.is_set():  # closed before the loop ran
                return
            self._wake = wake
        await self._serve(stop.is_set, wake)


class BackgroundTask(_Driver):
    """Runs the cores in one task of the running event loop, asyncio's or trio's (a trio system
    task), with one ``httpx.AsyncClient`` (async clients)."""

    def _init_state(self) -> None:
        self._stop = False
        self._wake: Wake | None = None
        self._scope: anyio.CancelScope | None = None
        self._done: anyio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        """The asyncio task (None under trio, where it is a system task)."""

    @property
    def running(self) -> bool:
        return self._done is not None and not self._done.is_set()

    def start(self) -> None:
        """Start the task on the running loop unless it runs there already (call from the loop)."""
        wake = self._wake
        if self.running and wake is not None and wake.loop.is_current():
            return
        # A task left on another loop (an earlier asyncio.run, trio.run) is dead with that loop.
        self._stop, self._wake, self._done = False, Wake(), anyio.Event()
        self._scope = anyio.CancelScope()
        if running_library() == "trio":
            sys.modules["trio"].lowlevel.spawn_system_task(
                self._run, self._scope, self._wake, self._done, name=self.name
            )
            self._task = None
        else:
            run = self._run(self._scope, self._wake, self._done)
            self._task = asyncio.get_running_loop().create_task(run, name=self.name)

    def wake(self) -> None:
        """Ask the cores for work now, not at the end of the current sleep (from any thread)."""
        wake = self._wake
        if wake is not None and self.running:
            wake.set()

    def cancel(self) -> None:
        """Stop the task without waiting for it; from any thread (its loop runs the cancel)."""
        scope, wake, self._scope = self._scope, self._wake, None
        if scope is not None and wake is not None:
            wake.loop.call_soon(scope.cancel)

    async def aclose(self) -> None:
        """Stop the task and wait for it (a task of another loop is only cancelled)."""
        scope, wake, done, self._scope = self._scope, self._wake, self._done, None
        self._stop = True
        if scope is None or wake is None or done is None or done.is_set():
            return
        if not wake.loop.is_current():
            wake.loop.call_soon(scope.cancel)  # another loop's task: it cannot be awaited from here
            return
        scope.cancel()
        await done.wait()

    async def _run(self, scope: anyio.CancelScope, wake: Wake, done: anyio.Event) -> None:
        try:
            with scope:
                await self._serve(lambda: self._stop or scope.cancel_called, wake)
        except Exception:  # a trio system task's error would end the caller's whole run
            logger.exception("pdclient background: %s failed", self.name)
        finally:
            done.set()


class Background:
    """One fleet's background work: its cores, and the driver that runs them once started."""

    def __init__(
        self,
        cores: Sequence[Core],
        *,
        asynchronous: bool,
        resolver: Resolver = system_resolver,
        name: str = "pdclient-background",
        max_sleep: float = 1.0,
    ) -> None:
        self.cores = tuple(cores)
        self.name = name
        """The driver thread's or task's name."""
        self.max_sleep = max_sleep
        """Seconds the driver sleeps at most: how late it sees work no one woke it for (a
        member added to a pool); each wake-up of an idle process costs CPU (~0.2 ms on the
        CPU pair's AMD EPYC)."""
        self.asynchronous = asynchronous
        """The fleet serves an async client: its driver is a task when started from an asyncio loop."""
        self._resolver = resolver
        self.task_http: Callable[[], HTTPClient] = httpx.AsyncClient
        """The HTTP client a task driver fetches with (``Fleet.send_background_with``); a
        thread's loop is its own, so a thread driver always makes one of its own."""
        self._driver: BackgroundThread | BackgroundTask | None = None
        self._closed = False
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"Background({list(self.cores)}, driver={self._driver!r})"

    @property
    def driver(self) -> BackgroundThread | BackgroundTask | None:
        """The driver once started (a thread or a task), else None."""
        return self._driver

    @property
    def running(self) -> bool:
        return self._driver is not None and self._driver.running

    def start(self) -> None:
        """Start the driver unless it runs (the transports call this on every call: cheap once running).

        An async client's task is started on the running loop; a later call from another
        loop (a second ``asyncio.run``) starts it there, the first one having died with its loop.
        """
        driver = self._driver
        if isinstance(driver, BackgroundThread):
            if not driver.running:
                driver.start()
            return
        if isinstance(driver, BackgroundTask):
            driver.start()
            return
        with self._lock:
            if self._closed:
                return
            if self._driver is None:
                self._driver = self._new_driver()
        self.start()

    def wake(self) -> None:
        """Have the driver ask its cores for work now (a job was just queued)."""
        driver = self._driver
        if driver is not None:
            driver.wake()

    def _new_driver(self) -> BackgroundThread | BackgroundTask:
        if self.asynchronous and running_library() is not None:  # no loop at all: a thread serves any caller
            return BackgroundTask(
                self.cores, resolver=self._resolver, http=self.task_http, max_sleep=self.max_sleep, name=self.name
            )
        return BackgroundThread(self.cores, resolver=self._resolver, max_sleep=self.max_sleep, name=self.name)

    def close(self, *, wait: bool = True) -> None:
        """Stop for good: a thread is stopped (and joined if ``wait``), a task cancelled on its loop."""
        with self._lock:
            self._closed = True
            driver, self._driver = self._driver, None
        if isinstance(driver, BackgroundThread):
            driver.close(timeout=5.0 if wait else 0.0)
        elif isinstance(driver, BackgroundTask):
            driver.cancel()

    async def aclose(self) -> None:
        """``close`` from async code: a task is awaited, a thread joined off the event loop."""
        with self._lock:
            self._closed = True
            driver, self._driver = self._driver, None
        if isinstance(driver, BackgroundTask):
            await driver.aclose()
        elif isinstance(driver, BackgroundThread):
            await anyio.to_thread.run_sync(driver.close)
