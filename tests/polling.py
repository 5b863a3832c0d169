"""The one way a test waits for work another thread or task does: poll a condition until it
holds, or fail with what it waited for."""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

INTERVAL = 0.01


def wait_until(condition: Callable[[], object], timeout: float = 10.0, what: str = "the condition") -> None:
    """Block until ``condition()`` is true; an ``AssertionError`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(INTERVAL)


async def until(condition: Callable[[], object], limit: float = 10.0, what: str = "the condition") -> None:
    """``wait_until`` (``limit``: its timeout) without blocking the event loop (asyncio or trio): the work it waits for
    may be a task on the same loop."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await anyio.sleep(INTERVAL)
