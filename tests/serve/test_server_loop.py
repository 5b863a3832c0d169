"""The server's main loop: woken once a minute, not ten times a second, and at once to stop;
the Date header current all the same."""

from __future__ import annotations

import time
from email.utils import parsedate_to_datetime
from typing import Any

import httpx

from pdclient.serve._protocol import ServerConfig
from pdclient.serve._server import Server

from .conftest import started_in_thread


class CountingServer(Server):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.ticks: list[int] = []
        self.stopped_at: float | None = None

    async def on_tick(self, counter: int) -> bool:
        self.ticks.append(counter)
        stop = await super().on_tick(counter)
        if stop:
            self.stopped_at = time.monotonic()
        return stop


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "http":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})


def test_the_main_loop_sleeps_and_wakes_at_once_to_stop_and_the_date_stays_current() -> None:
    config = ServerConfig(
        app, header_timeout=5, body_timeout=5, max_header_size=65536,
        host="127.0.0.1", port=0, log_config=None, lifespan="off",
    )  # fmt: skip
    server = CountingServer(config)
    thread, port = started_in_thread(server)
    first = httpx.get(f"http://127.0.0.1:{port}/").headers["date"]
    time.sleep(2.5)
    # uvicorn's own loop would have ticked ~25 times, and refreshed its Date header on tens.
    assert server.ticks == [0]
    date = httpx.get(f"http://127.0.0.1:{port}/").headers["date"]
    assert date != first and abs(parsedate_to_datetime(date).timestamp() - time.time()) < 2
    stopping = time.monotonic()
    server.should_exit = True  # from another thread, as the tests and uvicorn's signal handler set it
    thread.join(10)
    assert not thread.is_alive()
    assert server.stopped_at is not None and server.stopped_at - stopping < 0.5  # not at the next tick
