"""A push-mode prefill server posts no WRITE for a request it has reported done (lease ended
or push completed): vLLM PR #55470's case of a WRITE deferred to a handshake that completes
after the lease, on a stand-in worker with vLLM's real method names; the seams are checked
on vLLM 0.32's real NixlPushConnectorWorker."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from pdclient_server_patch import _stale_write


class Results:
    def __init__(self, finished_sending: set[str]) -> None:
        self.finished_sending = finished_sending


class Worker:
    """What the wrapped methods touch of vLLM's NixlPushConnectorWorker."""

    def __init__(self) -> None:
        self.done: set[str] = set()  # what the next get_transfer_results reports
        self.writes: list[tuple[str, str]] = []
        self.inside_get = threading.Event()
        self.release_get = threading.Event()
        self.release_get.set()

    def get_transfer_results(self) -> Results:
        self.inside_get.set()
        self.release_get.wait(5)
        done, self.done = self.done, set()
        return Results(done)

    def _do_start_push_kv(self, request_id: str, local_block_ids: Any, registration_data: dict[str, Any]) -> None:
        self.writes.append((request_id, registration_data["request_id"]))


get = _stale_write.wrap_get_transfer_results(Worker.get_transfer_results)
push = _stale_write.wrap_do_start_push_kv(Worker._do_start_push_kv)
REG = {"request_id": "decode-1"}


def test_off_by_default(plugin: Any) -> None:
    assert plugin.STATE.applied["stale write"].startswith("off"), plugin.STATE.applied


def test_bad_values_are_ignored(plugin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for raw in ("yes", "2", "true"):
        monkeypatch.setenv(plugin.STALE_WRITE_ENV, raw)
        assert plugin._flag(plugin.STALE_WRITE_ENV) is False
    monkeypatch.setenv(plugin.STALE_WRITE_ENV, "1")
    assert plugin._flag(plugin.STALE_WRITE_ENV) is True


def test_a_write_deferred_past_the_lease_is_refused() -> None:
    worker = Worker()
    push(worker, "p-1", ([1, 2],), REG)  # the handshake is ready: the WRITE goes
    worker.done = {"p-2"}  # p-2's lease ended while its handshake with the decode ran
    assert get(worker).finished_sending == {"p-2"}
    push(worker, "p-2", ([3, 4],), REG)  # the deferred inbox drains it
    push(worker, "p-3", ([5],), REG)
    assert worker.writes == [("p-1", "decode-1"), ("p-3", "decode-1")]


def test_a_completed_push_is_not_written_again() -> None:
    worker = Worker()
    push(worker, "p-1", ([1],), REG)
    worker.done = {"p-1"}
    get(worker)
    push(worker, "p-1", ([1],), {"request_id": "decode-retry"})  # a late registration with the same id
    assert worker.writes == [("p-1", "decode-1")]


def test_a_write_started_while_the_engine_reports_waits_for_the_mark() -> None:
    """The check and the WRITE are one step against the engine thread's report: a WRITE
    started while get_transfer_results runs goes after it, and sees the mark."""
    worker = Worker()
    worker.done = {"p-1"}
    worker.release_get.clear()
    reporter = threading.Thread(target=get, args=(worker,))
    reporter.start()
    assert worker.inside_get.wait(5)
    writer = threading.Thread(target=push, args=(worker, "p-1", ([1],), REG))
    writer.start()
    time.sleep(0.2)
    assert writer.is_alive()  # waiting for the report
    worker.release_get.set()
    reporter.join(5)
    writer.join(5)
    assert worker.writes == []


def test_marks_are_forgotten_in_time(monkeypatch: pytest.MonkeyPatch) -> None:
    worker = Worker()
    worker.done = {"p-1"}
    get(worker)
    later = time.monotonic() + _stale_write.FORGET_AFTER_S + 1
    monkeypatch.setattr(_stale_write.time, "monotonic", lambda: later)
    get(worker)
    assert not worker.__dict__[_stale_write.ABANDONED]


def test_patches_vllms_push_worker_once(vllm_version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not vllm_version.startswith("0.32"):
        pytest.skip("the push fixes are checked on vLLM 0.32 only")
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

    for name in ("get_transfer_results", "_do_start_push_kv"):
        monkeypatch.setattr(NixlPushConnectorWorker, name, NixlPushConnectorWorker.__dict__[name])
    # The contract the wrappers rely on: (self, request_id, local_block_ids, registration_data).
    params = list(inspect.signature(NixlPushConnectorWorker._do_start_push_kv).parameters)
    assert params == ["self", "request_id", "local_block_ids", "registration_data"]
    assert _stale_write.install().startswith("on")
    patched = NixlPushConnectorWorker._do_start_push_kv
    assert _stale_write.install().startswith("on")
    assert NixlPushConnectorWorker._do_start_push_kv is patched
