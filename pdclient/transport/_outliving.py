"""The async driver's rule for a concurrent call's prefill (``SendPrefill`` with ``outlive``):
read to its end even if its caller leaves meanwhile.

The decode sent with it has registered its blocks with the prefill server, and vLLM 0.32
frees the blocks of an aborted push-mode decode only once a WRITE lands (vLLM issue
#46283): a prefill cut with its caller would leave them held for good. So the caller's
cancel ends the decode and returns at once, and the prefill goes on in a task of its own
until its server answers; its WRITE then frees the decode's blocks. Under trio no task
outlives its caller's nursery: the prefill is read as any leg. A blocking caller cannot
leave mid-read, so the sync driver has no such rule.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx

from ..fleet import running_library


class Outliving:
    """Concurrent calls' prefills whose callers left before they answered, on one driver's
    connections: the transport's copies share that driver, as they share the connections,
    so whichever closes them first waits for every such prefill (``wait``)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Future[httpx.Response]] = set()

    async def read(
        self, read: Callable[[httpx.Request], Awaitable[httpx.Response]], request: httpx.Request
    ) -> httpx.Response:
        """``read(request)``, in a task of its own that outlives its caller (asyncio)."""
        if running_library() != "asyncio":
            return await read(request)
        task = asyncio.ensure_future(read(request))
        self._tasks.add(task)
        task.add_done_callback(self._outlived)
        return await asyncio.shield(task)

    def _outlived(self, task: asyncio.Future[httpx.Response]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # its caller, if it left, no longer reads it: retrieved here

    async def wait(self, seconds: float | None) -> None:
        """Wait, ``seconds`` (the prefill phase's bound) at most, for the prefills that outlive their
        callers: closing the legs' connections would abort them, and with them the WRITE that
        frees their decodes' blocks."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=seconds)


__all__ = ["Outliving"]
