"""One event loop for the whole test session.

vLLM 0.20's tokenizer wrapper (AsyncMicrobatchTokenizer) binds its queues to the first
event loop it sees, so each test must not bring its own (``asyncio.run``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")
LOOP = asyncio.new_event_loop()


def arun(awaitable: Awaitable[T]) -> T:
    return LOOP.run_until_complete(awaitable)
