"""uvicorn's server with its main loop woken once a minute, and at once when it should stop.

uvicorn's main loop wakes ten times a second to see whether it should stop, and refreshes
its ``Date`` header every tenth time. On a 2-core AMD EPYC VM with nothing else busy, those
wake-ups were nearly all of an idle proxy's CPU, ~2 ms a second (vllm-router's: 0.09); with
vLLM servers running beside it, ~0.3 ms. Woken once a second, an idle proxy still paid
~0.2 ms a wake-up on the CPU pair's Zen 1 EPYC: ~1 ms a call at the pace of vLLM's
multi-turn benchmark. Here the loop wakes once a minute; each request brings the ``Date``
header up to the second as its head ends (``_protocol.refresh_date``), and setting
``should_exit`` (uvicorn's signal handler, or anyone) wakes the loop at once, so a shutdown
starts as soon as it did. One process only: ``--workers`` processes are uvicorn's own, each
with uvicorn's own server (their requests refresh the header too).
"""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn

_TICK_SECONDS = 60
_TENTHS_PER_TICK = 10 * _TICK_SECONDS
"""uvicorn's ``on_tick`` counts tenths of a second: the ``Date`` header is refreshed on multiples of ten."""


class Server(uvicorn.Server):
    _loop: asyncio.AbstractEventLoop | None = None
    _wake: asyncio.Event | None = None
    _stopping = False

    @property
    def should_exit(self) -> bool:
        return self._stopping

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._stopping = value
        if value and self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: nothing waits any more
                self._loop.call_soon_threadsafe(self._wake.set)

    async def main_loop(self) -> None:
        loop = asyncio.get_running_loop()
        self._wake = wake = asyncio.Event()
        self._loop = loop
        counter = 0
        stop = await self.on_tick(counter)
        while not stop:
            counter = (counter + _TENTHS_PER_TICK) % 864000
            timer = loop.call_later(_TICK_SECONDS, wake.set)
            await wake.wait()
            timer.cancel()
            wake.clear()
            stop = await self.on_tick(counter)
