"""Helpers for the fleet tests on loopback stubs: waiting, other clients' load, and
stubs on several loopback addresses behind one name (the resolver hook)."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

import httpx

from tests.stubserver import StubServer

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}


def wait_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def await_until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


def hold(stub: StubServer, n: int) -> list[threading.Thread]:
    """``n`` streams to ``stub`` from other clients (another process, as far as the pool knows)."""

    def stream() -> None:
        with httpx.Client(timeout=30) as client:
            client.post(stub.url + "/chat/completions", json=CHAT).read()

    threads = [threading.Thread(target=stream) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def start_on(hosts: list[str], **kwargs: object) -> list[StubServer]:
    """Stubs on several loopback addresses, one port (as pods behind a headless Service)."""
    for _ in range(5):
        first = StubServer(host=hosts[0], **kwargs).start()  # type: ignore[arg-type]
        try:
            rest = [StubServer(host=h, port=first.port, **kwargs).start() for h in hosts[1:]]  # type: ignore[arg-type]
        except OSError:
            first.stop()
            continue
        return [first, *rest]
    raise RuntimeError("no common free port")


class Zone:
    """A resolver hook: what the name resolves to now (tests change it)."""

    def __init__(self, addresses: list[str], name: str = "vllm-decode.test") -> None:
        self.addresses = addresses
        self.name = name

    def __call__(self, host: str, port: int) -> list[str]:
        if host != self.name:
            raise OSError(f"unknown host {host}")
        return list(self.addresses)
