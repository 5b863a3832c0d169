"""An engine with nothing to compute waits for input instead of stepping every millisecond.

vLLM's engine-core loop steps as long as the scheduler has requests, including requests
that only wait for KV from elsewhere (``WAITING_FOR_REMOTE_KVS``). With nothing to run,
each step still schedules, sends an empty batch to the worker over shared memory, runs
the KV connector's bookkeeping there and reads the answer back; the loop then sleeps
1 ms and steps again. A pull-mode decode waits like that for a few milliseconds. A
push-mode decode (``NixlPushConnector``) registered before its prefill ran waits like
that for the whole prefill: measured on a 2-core host, its engine core and worker burned
~25 % and ~100 % of a core for seconds, and the engine core (which vLLM does not pin)
ran on the prefill server's core, slowing the very prefill it waited for.

``wait_when_idle`` keeps the loop's contract: after a step that ran no model while work is
pending, it waits on the engine's input queue for a while that doubles from 1 ms up to
``max_wait_s``, so a new request or an abort is handled at once, and the next step (which
is what notices the KV arrived) comes at most ``max_wait_s`` later. Any step that runs the
model resets the wait.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

PATCHED = "__pdclient_idle_wait__"
_FIRST_WAIT_S = 0.001


def wait_when_idle(max_wait_s: float) -> str:
    try:
        from vllm.v1.engine.core import EngineCoreProc
    except ImportError:
        return "skipped (no vllm.v1.engine.core.EngineCoreProc in this vLLM)"
    step = getattr(EngineCoreProc, "_process_engine_step", None)
    if step is None or not hasattr(EngineCoreProc, "_handle_client_request"):
        return "skipped (EngineCoreProc._process_engine_step missing: seam changed)"
    on = f"on (an engine waiting only for remote KV polls every {max_wait_s * 1000:g} ms at most)"
    if getattr(step, PATCHED, None) is not None:
        return on
    EngineCoreProc._process_engine_step = wrap_process_engine_step(step, max_wait_s)
    return on


def wrap_process_engine_step(step: Callable[[Any], bool], max_wait_s: float) -> Callable[[Any], bool]:
    def _process_engine_step(self: Any) -> bool:
        executed = step(self)
        if executed or not self.scheduler.has_requests():
            self.__dict__.pop(PATCHED, None)
            return executed
        wait = min(self.__dict__.get(PATCHED, _FIRST_WAIT_S / 2) * 2, max_wait_s)
        self.__dict__[PATCHED] = wait
        try:
            request = self.input_queue.get(timeout=wait)
        except queue.Empty:
            return executed
        # What the loop's own input handling would do with it on the next round.
        self._handle_client_request(*request)
        return executed

    setattr(_process_engine_step, PATCHED, max_wait_s)
    return _process_engine_step
