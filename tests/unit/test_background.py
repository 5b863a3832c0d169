"""The background drivers run sans-I/O cores: the thread and the task do the same work."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from pdclient import PDOptions
from pdclient.fleet import (
    MAX_ANSWER_BYTES,
    WARM_UP_LOAD_POLL,
    BackgroundTask,
    BackgroundThread,
    Fetch,
    Fetched,
    Fleet,
    Job,
    JobResult,
    LookedUp,
    Lookup,
    PrefillWarmer,
    fetch,
    host_header,
    system_resolver,
)
from pdclient.pools import BreakerSettings, Endpoint
from pdclient.routing import LoadSample
from tests.polling import until, wait_until


class Recorder:
    """A core that asks for the same jobs every ``interval`` seconds and records the outcomes."""

    def __init__(self, jobs: list[Job], interval: float = 0.01) -> None:
        self.jobs = jobs
        self.interval = interval
        self.next = 0.0
        self.outcomes: list[tuple[object, JobResult]] = []
        self.applied = threading.Event()

    def due(self, now: float) -> list[Job]:
        if now < self.next:
            return []
        self.next = now + self.interval
        return list(self.jobs)

    def next_due(self) -> float:
        return self.next

    def apply(self, job: Job, outcome: JobResult, now: float) -> None:
        self.outcomes.append((job.key, outcome))
        self.applied.set()

    def each_twice(self) -> bool:
        """Every job has come back at least twice (a lookup in a worker thread may lag the fetches)."""
        keys = [key for key, _ in self.outcomes]
        return all(keys.count(job.key) >= 2 for job in self.jobs)


def answer(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/boom":
        raise httpx.ConnectError("refused", request=request)
    seen = f"{request.headers['host']} sni={request.extensions.get('sni_hostname')}"
    return httpx.Response(200 if request.url.path == "/ok" else 503, text=seen)


def resolver(host: str, port: int) -> list[str]:
    if host == "missing.test":
        raise OSError("no such host")
    if host == "buggy.test":
        raise RuntimeError("a resolver hook with a bug")
    return ["127.0.0.2", "127.0.0.3"]


JOBS = [
    Job("ok", Fetch("http://10.0.0.1:8000/ok", 1.0)),
    Job("down", Fetch("http://10.0.0.1:8000/down", 1.0)),
    Job("boom", Fetch("http://10.0.0.1:8000/boom", 1.0)),
    Job("named", Fetch("https://10.0.0.1:8443/ok", 1.0, host="vllm.svc.test")),
    Job("dns", Lookup("vllm.svc.test", 8000)),
    Job("nodns", Lookup("missing.test", 8000)),
    Job("bug", Lookup("buggy.test", 8000)),
]


def check(outcomes: dict[object, JobResult]) -> None:
    assert outcomes["ok"] == Fetched(200, "10.0.0.1:8000 sni=None")
    assert outcomes["down"] == Fetched(503, "10.0.0.1:8000 sni=None") and not outcomes["down"].ok
    failed = outcomes["boom"]
    assert isinstance(failed, Fetched) and failed.status is None and "ConnectError" in (failed.error or "")
    assert outcomes["named"] == Fetched(200, "vllm.svc.test:8443 sni=vllm.svc.test")
    assert outcomes["dns"] == LookedUp(("127.0.0.2", "127.0.0.3"))
    nodns = outcomes["nodns"]
    assert isinstance(nodns, LookedUp) and nodns.addresses == () and "no such host" in (nodns.error or "")
    assert outcomes["bug"] == LookedUp(error="RuntimeError: a resolver hook with a bug"), "a job's bug is its outcome"


def test_thread_driver_runs_jobs_until_closed() -> None:
    core = Recorder(JOBS)
    driver = BackgroundThread(
        [core], resolver=resolver, http=lambda: httpx.AsyncClient(transport=httpx.MockTransport(answer))
    )
    assert not driver.running, "nothing runs before start()"
    driver.start()
    driver.start()  # idempotent
    wait_until(core.each_twice)
    driver.close()
    assert not driver.running
    check(dict(core.outcomes))
    count = len(core.outcomes)
    time.sleep(0.05)
    assert len(core.outcomes) == count, "closed: no more work"


async def test_task_driver_runs_jobs_until_closed() -> None:
    core = Recorder(JOBS)
    driver = BackgroundTask(
        [core], resolver=resolver, http=lambda: httpx.AsyncClient(transport=httpx.MockTransport(answer))
    )
    assert not driver.running
    driver.start()
    driver.start()
    await until(core.each_twice)
    await driver.aclose()
    assert not driver.running
    check(dict(core.outcomes))


def test_task_driver_restarts_on_a_new_loop() -> None:
    core = Recorder(JOBS[:1])
    driver = BackgroundTask([core], http=lambda: httpx.AsyncClient(transport=httpx.MockTransport(answer)))

    async def use() -> None:
        driver.start()
        await until(core.applied.is_set)
        core.applied.clear()

    asyncio.run(use())  # the loop ends without aclose(): its task dies with it
    asyncio.run(use())  # a second loop gets a task of its own
    assert len(core.outcomes) >= 2


def test_a_failing_core_does_not_stop_the_others() -> None:
    class Broken(Recorder):
        def due(self, now: float) -> list[Job]:
            raise RuntimeError("bug")

    good = Recorder(JOBS[:1])
    driver = BackgroundThread(
        [Broken([]), good], http=lambda: httpx.AsyncClient(transport=httpx.MockTransport(answer)), max_sleep=0.01
    )
    driver.start()
    wait_until(lambda: len(good.outcomes) >= 3)
    driver.close()


def test_sleeps_until_the_next_due_job() -> None:
    core = Recorder(JOBS[:1], interval=0.2)
    driver = BackgroundThread([core], http=lambda: httpx.AsyncClient(transport=httpx.MockTransport(answer)))
    driver.start()
    time.sleep(0.5)
    driver.close()
    assert 2 <= len(core.outcomes) <= 4


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://10.0.0.1:8000/v1", "svc:8000"),
        ("https://10.0.0.1/v1", "svc"),
        ("http://[fd00::1]:8080/v1", "svc:8080"),
        ("http://10.0.0.1:80/v1", "svc"),
    ],
)
def test_host_header_keeps_an_explicit_port(url: str, expected: str) -> None:
    assert host_header(httpx.URL(url), "svc") == expected


def test_system_resolver_finds_loopback() -> None:
    assert "127.0.0.1" in system_resolver("localhost", 80) or "::1" in system_resolver("localhost", 80)


def echo_post(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, text=f"{request.method} {request.headers['authorization']} {request.content.decode()}")


def test_thread_driver_posts_a_queued_warm_up_at_once() -> None:
    warmer = PrefillWarmer()
    driver = BackgroundThread(
        [warmer], http=lambda: httpx.AsyncClient(transport=httpx.MockTransport(echo_post)), max_sleep=60.0
    )
    driver.start()
    wait_until(lambda: driver.running)
    time.sleep(0.05)  # asleep, for up to a minute
    warmer.add(Fetch("http://10.0.0.1:8000/v1/chat/completions", 1.0, None, b"{}", (("authorization", "Bearer k"),)))
    driver.wake()
    wait_until(lambda: warmer.posted == 1, timeout=2.0)
    driver.close()


class Legs(httpx.MockTransport):
    """The legs' transport of an async client: it answers, and says whether it was closed."""

    closed = False

    async def aclose(self) -> None:
        self.closed = True


async def test_an_async_fleet_sends_its_warm_ups_with_the_legs_transport_and_leaves_it_open() -> None:
    # pdclient serve's legs go by aiohttp, a third of httpx's CPU a request: its warm-ups too.
    legs = Legs(echo_post)
    urls = {"prefill_base_url": "http://10.0.0.1:8000/v1", "decode_base_url": "http://10.0.0.2:8000/v1"}
    fleet = Fleet(PDOptions(**urls), asynchronous=True)
    fleet.send_background_with(legs)
    (endpoint,) = fleet.prefill.endpoints
    fleet.warm(endpoint, Fetch("http://10.0.0.1:8000/v1/chat/completions", 1.0, None, b"{}", (("authorization", "B"),)))
    await until(lambda: fleet.warmer.posted == 1, limit=2.0)
    await fleet.aclose()
    assert not legs.closed


async def test_task_driver_posts_a_queued_warm_up_at_once() -> None:
    warmer = PrefillWarmer()
    driver = BackgroundTask(
        [warmer], http=lambda: httpx.AsyncClient(transport=httpx.MockTransport(echo_post)), max_sleep=60.0
    )
    driver.start()
    await asyncio.sleep(0.05)
    warmer.add(Fetch("http://10.0.0.1:8000/v1/chat/completions", 1.0, None, b"{}", (("authorization", "Bearer k"),)))
    driver.wake()
    await until(lambda: warmer.posted == 1, limit=2.0)
    await driver.aclose()


async def test_a_post_sends_its_content_and_headers() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(echo_post)) as http:
        fetched = await fetch(http, Fetch("http://10.0.0.1:8000/x", 1.0, None, b'{"a":1}', (("authorization", "B k"),)))
    assert fetched == Fetched(200, 'POST B k {"a":1}')


async def test_a_fetch_has_one_deadline_for_its_whole_answer() -> None:
    async def drip() -> AsyncIterator[bytes]:
        for _ in range(100):  # each byte well within any per-read timeout: 5 s in all
            yield b"#"
            await asyncio.sleep(0.05)

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/huge":
            return httpx.Response(200, content=b"#" * (MAX_ANSWER_BYTES + 1))
        return httpx.Response(200, content=drip())

    async with httpx.AsyncClient(transport=httpx.MockTransport(answer)) as http:
        started = time.monotonic()
        dripped = await fetch(http, Fetch("http://10.0.0.1:8000/metrics", 0.3))
        assert time.monotonic() - started < 1.0
        huge = await fetch(http, Fetch("http://10.0.0.1:8000/huge", 5.0))
    assert dripped == Fetched(None, error="TimeoutError: no whole answer within 0.3 s")
    assert huge.status is None and "longer than" in (huge.error or "")


def test_the_warm_up_queue_is_bounded_and_drops_the_oldest() -> None:
    warmer = PrefillWarmer(capacity=2)
    assert warmer.next_due() == float("inf")
    for n in range(3):
        warmer.add(Fetch(f"http://p/{n}", 1.0, None, b"{}"))
    assert warmer.next_due() == 0.0 and warmer.dropped == 1
    jobs = warmer.due(0.0)
    assert [job.action.url for job in jobs] == ["http://p/1", "http://p/2"]  # type: ignore[union-attr]
    assert warmer.due(0.0) == [] and warmer.next_due() == float("inf")
    warmer.apply(jobs[0], Fetched(200), 0.0)
    warmer.apply(jobs[1], Fetched(None, error="ConnectError"), 0.0)
    assert (warmer.posted, warmer.failed) == (1, 1)


def test_the_warmer_counts_what_the_prefill_computed() -> None:
    warmer = PrefillWarmer()
    warmer.add(Fetch("http://p/1", 1.0, None, b"{}"))
    warmer.add(Fetch("http://p/2", 1.0, None, b"{}"))
    assert warmer.pending == 2
    first, second = warmer.due(0.0)
    usage = '{"usage": {"prompt_tokens": 700, "prompt_tokens_details": {"cached_tokens": 512}}}'
    warmer.apply(first, Fetched(200, usage), 0.0)
    warmer.apply(second, Fetched(200, "not json"), 0.0)
    assert (warmer.prompt_tokens, warmer.cached_tokens, warmer.pending) == (700, 512, 0)


def test_warm_ups_take_turns_on_their_prefill_server() -> None:
    # Two at once on one server would each slow the other and any caller's prefill there.
    p, q = (Endpoint(url, BreakerSettings(), time.monotonic) for url in ("http://p/v1", "http://q/v1"))
    warmer = PrefillWarmer()
    warmer.add(Fetch("http://p/v1/chat/completions", 1.0, None, b"1"), p)
    warmer.add(Fetch("http://p/v1/chat/completions", 1.0, None, b"2"), p)
    warmer.add(Fetch("http://q/v1/chat/completions", 1.0, None, b"3"), q)
    first = warmer.due(0.0)
    assert [job.action.content for job in first] == [b"1", b"3"]  # type: ignore[union-attr]
    assert warmer.due(0.0) == [] and warmer.next_due() == float("inf")  # the end of one wakes the driver
    warmer.apply(first[0], Fetched(200), 0.1)
    assert [job.action.content for job in warmer.due(0.1)] == [b"2"]  # type: ignore[union-attr]


def test_a_warm_up_waits_while_a_caller_prefills_on_its_server() -> None:
    # A warm-up is nobody's answer: a caller's prefill on that server must not queue behind it.
    endpoint = Endpoint("http://p/v1", BreakerSettings(), time.monotonic)
    woken: list[str] = []
    warmer = PrefillWarmer(wake=lambda: woken.append("woken"))
    warmer.add(Fetch("http://p/v1/chat/completions", 1.0, None, b"1"), endpoint)
    endpoint.acquire()  # two callers' prefill legs
    endpoint.acquire()
    assert warmer.due(5.0) == [] and warmer.due(5.01) == []
    # No polling while it waits: the end of the last caller's leg wakes the driver, once.
    assert warmer.next_due() == float("inf") and warmer.pending == 1
    endpoint.release(ok=True)
    assert woken == []
    endpoint.release(ok=True)
    assert woken == ["woken"] and warmer.next_due() == 0.0
    (job,) = warmer.due(5.05)
    assert job.action.content == b"1"  # type: ignore[union-attr]


def test_an_endpoint_idle_already_calls_back_at_once() -> None:
    # A release between the warmer's look and its asking must not leave the warm-up asleep.
    endpoint = Endpoint("http://p/v1", BreakerSettings(), time.monotonic)
    woken: list[int] = []
    endpoint.when_idle(lambda: woken.append(1))
    assert woken == [1]


def test_a_warm_up_waits_while_others_requests_queue_on_its_server() -> None:
    # Others' requests waiting there, by the last fresh scrape: looked at again with the next scrape.
    endpoint = Endpoint("http://p/v1", BreakerSettings(), time.monotonic)
    endpoint.load = LoadSample(waiting=2, running=1, kv_usage=None, taken_at=5.0, fresh_until=7.0, local_in_flight=0)
    warmer = PrefillWarmer()
    warmer.add(Fetch("http://p/v1/chat/completions", 1.0, None, b"1"), endpoint)
    assert warmer.due(5.0) == []
    assert warmer.next_due() == 5.0 + WARM_UP_LOAD_POLL
    (job,) = warmer.due(7.0)  # the sample went stale
    assert job.action.content == b"1"  # type: ignore[union-attr]
