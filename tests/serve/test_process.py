"""A real `python -m pdclient serve` process: graceful SIGTERM, --workers with shared metrics."""

from __future__ import annotations

import gc
import re
import signal
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.stubserver import Fault, StubServer

from .conftest import MESSAGES, ServeProcess, metric_samples

CHAT = {"model": "m", "messages": MESSAGES}
CALL_LINE = re.compile(r"INFO pdclient\.serve \[(\d+)\]: call ")


@pytest.fixture
def stub() -> Iterator[StubServer]:
    with StubServer(prompt_tokens=32) as server:
        yield server


def refused(url: str) -> bool:
    """Whether a new connection is refused. One made as the shutdown starts may still be
    accepted, then closed unanswered or left waiting: not refused yet, asked again."""
    try:
        httpx.get(url + "/health", timeout=1)
    except httpx.ConnectError:
        return True
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.ReadTimeout):
        return False
    return False


def exited_gracefully(code: int | None) -> bool:
    # uvicorn re-raises the SIGTERM it caught once it has shut down: the conventional status.
    return code in (0, -signal.SIGTERM)


def test_sigterm_lets_a_stream_finish_and_refuses_new_connections(stub: StubServer) -> None:
    stub.inject(Fault(event_delay=0.4), leg="decode")  # 7 events: ~2.4 s
    serve = ServeProcess("--prefill", stub.url, "--decode", stub.url, "--grace-period", "20")
    try:
        events: list[str] = []
        with (
            httpx.Client(timeout=10) as http,
            http.stream("POST", serve.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as response,
        ):
            lines = response.iter_lines()
            for line in lines:
                if line.startswith("data: "):
                    events.append(line)
                    break
            signalled = time.monotonic()
            serve.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 3
            while not refused(serve.url):
                assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
                time.sleep(0.05)
            assert serve.proc.poll() is None, "exited with a stream in flight"
            events += [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) == 7
        serve.proc.wait(10)
        assert exited_gracefully(serve.proc.returncode), serve.stderr()
        assert time.monotonic() - signalled < 10
        assert [s.how for s in stub.streams] == ["completed"]
    finally:
        serve.stop()


def test_sigterm_closes_streams_still_running_after_the_grace_period(stub: StubServer) -> None:
    stub.inject(Fault(event_delay=1.0), leg="decode")  # 7 events: ~6 s
    serve = ServeProcess("--prefill", stub.url, "--decode", stub.url, "--grace-period", "1")
    try:
        with (
            httpx.Client(timeout=10) as http,
            http.stream("POST", serve.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as response,
        ):
            lines = response.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            signalled = time.monotonic()
            serve.proc.send_signal(signal.SIGTERM)
            with pytest.raises(httpx.RemoteProtocolError):  # the stream is cut, not ended
                for _ in lines:
                    pass
        serve.proc.wait(10)
        took = time.monotonic() - signalled
        assert 0.9 < took < 10, took  # the grace period (1 s), then shutdown
        assert exited_gracefully(serve.proc.returncode), serve.stderr()
        # The proxy closed its upstream decode connection too.
        deadline = time.monotonic() + 3
        while not stub.streams:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert stub.streams[0].how == "client closed"
    finally:
        serve.stop()


def test_workers_share_their_metrics_and_shut_down_gracefully(stub: StubServer) -> None:
    serve = ServeProcess("--prefill", stub.url, "--decode", stub.url, "--grace-period", "20", workers=2)
    try:
        calls = 8
        for _ in range(calls):  # a new connection each time: the kernel spreads them over the workers
            with httpx.Client(timeout=10, headers={"connection": "close"}) as http:
                assert http.post(serve.url + "/v1/chat/completions", json=CHAT).status_code == 200
        for _ in range(4):
            with httpx.Client(timeout=10, headers={"connection": "close"}) as http:
                text = http.get(serve.url + "/metrics").text
            samples = metric_samples(text)
            assert [v for (name, _), v in samples.items() if name == "pdclient_build_info"] == [1]
            assert "_created" not in text
            key = ("pdclient_calls_total", (("outcome", "disaggregated"), ("route", "chat")))
            assert samples[key] == calls  # whichever worker answers, it counts every worker's calls
            assert samples[("pdclient_calls_in_flight", (("route", "chat"),))] == 0
        stub.inject(Fault(event_delay=0.4), leg="decode")  # 7 events: ~2.4 s
        with (
            httpx.Client(timeout=10) as http,
            http.stream("POST", serve.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as response,
        ):
            lines = response.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            serve.proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 3  # the supervisor looks at its signals twice a second
            while not refused(serve.url):
                assert time.monotonic() < deadline, "still accepting connections after SIGTERM"
                time.sleep(0.05)
            events += [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) == 7
        serve.proc.wait(15)
    finally:
        serve.stop()
    assert exited_gracefully(serve.proc.returncode), serve.stderr()
    # Each call's log line names its worker: both served calls, else the sums above prove nothing.
    workers = {m.group(1) for line in serve.lines if (m := CALL_LINE.search(line))}
    assert len(workers) == 2, serve.stderr()


def test_a_started_process_is_settled_out_of_full_collections() -> None:
    """What a started proxy holds leaves the collector's full walks; its garbage is collected first."""
    from pdclient.serve._run import settle

    try:
        settle()
        assert gc.get_freeze_count() > 0
        assert gc.get_count()[0] < 50  # collected just before, nothing of startup's garbage kept
    finally:
        gc.unfreeze()


@pytest.mark.parametrize(("mode", "started"), [("auto", True), ("always", False)])
def test_the_warm_up_driver_starts_with_the_app_when_calls_may_warm(mode: str, started: bool) -> None:
    """Its first start imports httpcore and builds an HTTP client (~0.15 s of CPU here): with
    the app, not in the middle of the first decode-only call, on the loop every stream runs on."""
    import asyncio

    from pdclient.serve import create_app
    from pdclient.serve._config import ServeConfig

    settings = {"prefill": ["http://127.0.0.1:9/v1"], "decode": ["http://127.0.0.1:9/v1"], "remote_prefill": mode}
    app = create_app(ServeConfig.from_mapping(settings))

    async def main() -> bool:
        async with app.router.lifespan_context(app):
            await asyncio.sleep(0)
            return any(task.get_name() == "pdclient-warm-up" for task in asyncio.all_tasks())

    assert asyncio.run(main()) is started
