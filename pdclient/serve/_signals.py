"""The shutdown signals: ``/ready`` says 503 from SIGTERM / SIGINT on, before the server's own
handler starts its graceful shutdown."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any


@contextlib.contextmanager
def on_shutdown_signal(callback: Callable[[], None]) -> Iterator[None]:
    """While the block runs, SIGTERM and SIGINT call ``callback`` first, then the handler
    installed before (the server's own: uvicorn's starts its graceful shutdown).

    uvicorn closes its listener at its next tick after the signal, and a load balancer may
    still send a request or two until it has seen the pod go: ``/ready`` must say 503 from
    the signal on. Signals are caught only in the main thread, as the server itself catches
    them; an app served from another thread gets nothing here.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before: dict[signal.Signals, Any] = {}

    def caught(sig: int, frame: FrameType | None) -> None:
        handler = before.get(signal.Signals(sig))
        if handler == signal.SIG_IGN:  # a signal ignored before does not shut anything down
            return
        callback()
        if callable(handler):
            handler(sig, frame)
        elif handler in (signal.SIG_DFL, None):  # caught by no one before: what the signal does by default
            signal.signal(sig, signal.SIG_DFL)
            signal.raise_signal(sig)

    for sig in (signal.SIGTERM, signal.SIGINT):
        before[sig] = signal.signal(sig, caught)
    try:
        yield
    finally:
        for sig, handler in before.items():
            if signal.getsignal(sig) is caught:
                signal.signal(sig, signal.SIG_DFL if handler is None else handler)
