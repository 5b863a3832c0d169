"""A push-mode decode aborted while it waits for remote KV gets its blocks back once the
prefill's lease plus PDCLIENT_PUSH_RECLAIM_GRACE_S has passed with no WRITE (vLLM PR #46289's
case, on vLLM's real Scheduler and NixlPushConnector scheduler side); a completion that
arrives after that is dropped instead of failing the scheduler's assertion."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from pdclient_server_patch import _push_reclaim

LEASE_S = 30
GRACE_S = 5.0


@pytest.fixture(scope="module")
def vllm_config(vllm_version: str, model_dir: str) -> Any:
    if not vllm_version.startswith("0.32"):
        pytest.skip("the push fixes are checked on vLLM 0.32 only")
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    transfer = KVTransferConfig(
        kv_connector="NixlPushConnector",
        kv_role="kv_both",
        kv_buffer_device="cpu",
        kv_connector_extra_config={"kv_lease_duration": LEASE_S},
    )
    engine_args = EngineArgs(
        model=model_dir, max_model_len=2048, dtype="bfloat16", enforce_eager=True, kv_transfer_config=transfer
    )
    config = engine_args.create_engine_config()
    config.cache_config.num_gpu_blocks = 100
    return config


@pytest.fixture
def patched(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """vLLM's classes patched for one test, restored after it."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import NixlPushConnectorScheduler
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
    from vllm.v1.core.sched.scheduler import Scheduler

    for cls, name in (
        (Scheduler, "finish_requests"),
        (Scheduler, "update_from_output"),
        (Scheduler, "_update_from_kv_xfer_finished"),
        (NixlPushConnectorScheduler, "build_connector_meta"),
        (NixlPushConnectorWorker, "start_load_kv"),
    ):
        monkeypatch.setattr(cls, name, cls.__dict__[name])
    assert _push_reclaim.install(GRACE_S).startswith("on")
    yield


def scheduler(vllm_config: Any) -> Any:
    """vLLM's real Scheduler, its KV connector the real NixlPushConnector (scheduler side)."""
    import torch
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    block_size = vllm_config.cache_config.block_size
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=16, dtype=torch.bfloat16)
    kv_cache = KVCacheConfig(num_blocks=100, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=True,
    )


def waiting_decode(sched: Any, request_id: str = "d1") -> Any:
    """A decode registered for a push, as pdclient's concurrent dispatch sends it: scheduled
    once, its blocks allocated and its registration in the step's connector metadata."""
    from vllm import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    kv = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "prefill-engine",
        "remote_host": "127.0.0.1",
        "remote_port": 5600,
        "tp_size": 1,
        "remote_request_id": request_id,
    }
    params = SamplingParams(max_tokens=8, extra_args={"kv_transfer_params": kv})
    request = Request(
        request_id=request_id,
        prompt_token_ids=list(range(1, 300)),
        sampling_params=params,
        pooling_params=None,
        arrival_time=0.0,
    )
    sched.add_request(request)
    out = sched.schedule()
    assert request_id in out.kv_connector_metadata.push_registrations
    step(sched, out)
    assert request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert sched.kv_cache_manager.usage > 0
    return request


def step(sched: Any, out: Any = None, **kv_output: Any) -> Any:
    """One engine step with nothing to run, the workers reporting ``kv_output``."""
    from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

    out = sched.schedule() if out is None else out
    connector = KVConnectorOutput(**kv_output) if kv_output else None
    sched.update_from_output(out, ModelRunnerOutput(req_ids=[], req_id_to_index={}, kv_connector_output=connector))
    return out


def abort(sched: Any, request_id: str = "d1") -> None:
    from vllm.v1.request import RequestStatus

    sched.finish_requests(request_id, RequestStatus.FINISHED_ABORTED)


def test_off_by_default(plugin: Any) -> None:
    assert plugin.STATE.applied["push reclaim"].startswith("off"), plugin.STATE.applied


def test_bad_values_are_ignored(plugin: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for raw in ("abc", "-5", "7200"):
        monkeypatch.setenv(plugin.PUSH_RECLAIM_ENV, raw)
        assert plugin._push_reclaim_grace_s() == 0
    monkeypatch.setenv(plugin.PUSH_RECLAIM_ENV, "10")
    assert plugin._push_reclaim_grace_s() == 10


def test_vllm_still_holds_an_aborted_waiting_decode(vllm_config: Any) -> None:
    """The control, and the test that says when the patch is no longer needed: unpatched,
    the aborted decode's blocks are held with no deadline, only a WRITE's completion frees them."""
    sched = scheduler(vllm_config)
    waiting_decode(sched)
    abort(sched)
    for _ in range(3):
        step(sched)
    assert sched.kv_cache_manager.usage > 0 and "d1" in sched.requests and sched.has_requests()
    assert _push_reclaim.reclaim_expired(sched, now=time.monotonic() + 10 * LEASE_S) == []  # nothing armed
    step(sched, finished_recving={"d1"})
    assert sched.kv_cache_manager.usage == 0 and not sched.requests


def test_aborted_waiting_decode_is_reclaimed_after_the_lease_and_grace(vllm_config: Any, patched: None) -> None:
    sched = scheduler(vllm_config)
    waiting_decode(sched)
    aborted_at = time.monotonic()
    abort(sched)
    (deadline,) = sched.__dict__[_push_reclaim.DEADLINES].values()
    assert LEASE_S + GRACE_S <= deadline - aborted_at < LEASE_S + GRACE_S + 5
    step(sched)
    assert sched.kv_cache_manager.usage > 0  # a WRITE may still come within the lease
    assert _push_reclaim.reclaim_expired(sched, now=deadline - 0.5) == []
    assert _push_reclaim.reclaim_expired(sched, now=deadline + 0.5) == ["d1"]
    assert sched.kv_cache_manager.usage == 0
    assert not sched.requests and not sched.has_requests()  # the engine loop stops stepping
    # The decode workers forget the receive with the next step's metadata.
    out = step(sched)
    assert getattr(out.kv_connector_metadata, _push_reclaim.META_ATTR) == {"d1"}
    # A completion reported after the reclaim is dropped (unpatched: AssertionError).
    step(sched, finished_recving={"d1"})
    assert sched.kv_cache_manager.usage == 0 and not sched.requests


def test_a_write_within_the_lease_frees_as_vllm_does(
    vllm_config: Any, patched: None, caplog: pytest.LogCaptureFixture
) -> None:
    sched = scheduler(vllm_config)
    waiting_decode(sched)
    abort(sched)
    step(sched, finished_recving={"d1"})
    assert sched.kv_cache_manager.usage == 0 and not sched.requests
    with caplog.at_level(logging.INFO, logger=_push_reclaim.logger.name):
        _push_reclaim.logger.addHandler(caplog.handler)
        try:
            assert _push_reclaim.reclaim_expired(sched, now=time.monotonic() + 10 * LEASE_S) == []
        finally:
            _push_reclaim.logger.removeHandler(caplog.handler)
    assert not sched.__dict__[_push_reclaim.DEADLINES]
    # The log says the transfer ended the wait (a WRITE here, a PUSH_FAIL alike), not a reclaim.
    assert [r.getMessage() for r in caplog.records] == [
        "pdclient_reuse: request d1: its transfer ended, vLLM freed its blocks; no reclaim"
    ]


def test_the_sweep_runs_in_the_engine_step(vllm_config: Any, patched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    sched = scheduler(vllm_config)
    waiting_decode(sched)
    abort(sched)
    later = time.monotonic() + LEASE_S + GRACE_S + 1
    monkeypatch.setattr(_push_reclaim.time, "monotonic", lambda: later)
    from vllm.v1.outputs import ModelRunnerOutput

    outputs = sched.update_from_output(sched.schedule(), ModelRunnerOutput(req_ids=[], req_id_to_index={}))
    assert sched.kv_cache_manager.usage == 0 and not sched.requests
    # That step's stats (what /metrics shows) already count the blocks free: the engine,
    # left with no request, steps no more.
    assert outputs[0].scheduler_stats.kv_cache_usage == 0
    assert not sched.has_requests()


def test_other_requests_are_left_alone(vllm_config: Any, patched: None) -> None:
    """A waiting decode not aborted, and an abort of a request whose KV had arrived, arm nothing."""
    sched = scheduler(vllm_config)
    waiting_decode(sched, "kept")
    waiting_decode(sched, "arrived")
    step(sched, finished_recving={"arrived"})
    abort(sched, "arrived")
    assert not sched.__dict__.get(_push_reclaim.DEADLINES)
    assert _push_reclaim.reclaim_expired(sched, now=time.monotonic() + 10 * LEASE_S) == []
    assert "kept" in sched.requests


def test_a_pull_mode_scheduler_is_not_tracked() -> None:
    class PullSide:
        _TRANSFER_MODE = "pull"
        _kv_lease_duration = 30

    class Connector:
        connector_scheduler = PullSide()

    class Sched:
        connector = Connector()

    assert _push_reclaim.push_scheduler(Sched()) is None
    assert _push_reclaim._lease_s(Sched()) == _push_reclaim._NO_LEASE


def test_the_decode_worker_forgets_a_reclaimed_receive() -> None:
    class Worker:
        def __init__(self) -> None:
            self._recving_metadata = {"d1": object(), "d2": object()}
            self._recving_transfers = {"d1": []}
            self.consumer_notification_counts_by_req = {"d1": 1}
            self.started: list[Any] = []

    class Meta:
        def __init__(self) -> None:
            self.pdclient_reclaimed = {"d1"}

    start = _push_reclaim.wrap_start_load_kv(lambda self, meta: self.started.append(meta))
    worker, meta = Worker(), Meta()
    start(worker, meta)
    assert list(worker._recving_metadata) == ["d2"]
    assert not worker._recving_transfers and not worker.consumer_notification_counts_by_req
    assert worker.started == [meta]
