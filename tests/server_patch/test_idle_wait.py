"""An engine whose only work is waiting for remote KV waits on its input queue between steps
(up to PDCLIENT_IDLE_WAIT_MS) instead of stepping every millisecond; new input is still
handled at once, and a step that runs the model resets the wait."""

from __future__ import annotations

import queue
import time
from typing import Any

import pytest
from pdclient_server_patch import _idle_wait


class Engine:
    """What the wrapped step reads of vLLM's EngineCoreProc."""

    def __init__(self, executed: bool, pending: bool) -> None:
        self.executed, self.pending = executed, pending
        self.input_queue: queue.Queue[tuple[str, Any]] = queue.Queue()
        self.handled: list[tuple[str, Any]] = []
        self.steps = 0

        class Scheduler:
            def has_requests(_self) -> bool:
                return self.pending

        self.scheduler = Scheduler()

    def _handle_client_request(self, kind: str, request: Any) -> None:
        self.handled.append((kind, request))


def _step(engine: Engine) -> bool:
    engine.steps += 1
    return engine.executed


def _timed(step: Any, engine: Engine) -> float:
    start = time.perf_counter()
    step(engine)
    return time.perf_counter() - start


def test_off_by_default(plugin: Any) -> None:
    assert plugin.STATE.applied["idle wait"].startswith("off"), plugin.STATE.applied


def test_bad_values_are_ignored(plugin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for raw in ("abc", "-5", "5000"):
        monkeypatch.setenv(plugin.IDLE_WAIT_ENV, raw)
        assert plugin._idle_wait_ms() == 0
    monkeypatch.setenv(plugin.IDLE_WAIT_ENV, "10")
    assert plugin._idle_wait_ms() == 10


def test_patches_vllms_engine_loop_once(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.engine.core import EngineCoreProc

    original = EngineCoreProc.__dict__["_process_engine_step"]
    monkeypatch.setattr(EngineCoreProc, "_process_engine_step", original)
    assert _idle_wait.wait_when_idle(0.01).startswith("on")
    patched = EngineCoreProc._process_engine_step
    assert patched is not original
    assert _idle_wait.wait_when_idle(0.01).startswith("on")  # idempotent
    assert EngineCoreProc._process_engine_step is patched


def test_idle_steps_wait_longer_up_to_the_cap() -> None:
    step = _idle_wait.wrap_process_engine_step(_step, 0.02)
    engine = Engine(executed=False, pending=True)
    waits = [_timed(step, engine) for _ in range(8)]
    assert engine.steps == 8
    assert waits[0] < 0.015, waits  # the first wait is short: KV may be about to land
    assert all(0.018 <= w < 0.2 for w in waits[-3:]), waits  # then the cap


def test_new_input_is_handled_at_once() -> None:
    step = _idle_wait.wrap_process_engine_step(_step, 5.0)
    engine = Engine(executed=False, pending=True)
    for _ in range(4):
        step(engine)  # the wait has grown to 8 ms
    engine.input_queue.put(("ADD", "request-1"))
    assert _timed(step, engine) < 1.0
    assert engine.handled == [("ADD", "request-1")]


def test_no_wait_after_a_model_step_or_without_work() -> None:
    step = _idle_wait.wrap_process_engine_step(_step, 5.0)
    busy, idle = Engine(executed=True, pending=True), Engine(executed=False, pending=False)
    assert max(_timed(step, busy) for _ in range(5)) < 0.5
    assert max(_timed(step, idle) for _ in range(5)) < 0.5
    # A model step resets the wait: the next idle step waits the first, short while.
    engine = Engine(executed=False, pending=True)
    for _ in range(6):
        step(engine)
    engine.executed = True
    step(engine)
    engine.executed = False
    assert _timed(step, engine) < 0.5
