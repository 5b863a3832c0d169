"""A push-mode prefill server that posts no WRITE tells the decode (``PUSH_FAIL``), and the
decode fails the request once every WRITE it was owed has landed or been reported: vLLM PR
#50754's cases (the unposted rank alone is told; a failure does not land before a sibling
WRITE), plus the stale-write refusal and a late registration, on a stand-in worker with
vLLM 0.32's method names; the seams are checked on vLLM 0.32's real NixlPushConnectorWorker."""

from __future__ import annotations

import queue
import threading
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
from pdclient_server_patch import _push_fail, _stale_write

DECODE = "decode-engine"
REG_PREFIX = b"PUSH_REG:"


def base_id(request_id: str) -> str:
    return request_id.rsplit("-", 1)[0]  # what vLLM's get_base_request_id strips: the random suffix


class Nixl:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []

    def send_notif(self, agent: str, notif_msg: bytes) -> None:
        self.sent.append((agent, notif_msg))


class Worker:
    """What the wrapped methods touch of vLLM 0.32's NixlPushConnectorWorker, both sides."""

    def __init__(self, decode_ranks: tuple[int, ...] = (0,), world_size: int = 1) -> None:
        self.world_size = world_size
        self.nixl_wrapper = Nixl()
        self._handshake_lock = threading.RLock()
        self._remote_agents = {DECODE: {(0, r): f"agent-{r}" for r in decode_ranks}}
        self.tp_mappings = {DECODE: SimpleNamespace(all_source_ranks=decode_ranks)}
        self.transfer_topo = SimpleNamespace(
            get_engine_info=lambda engine: SimpleNamespace(remote_tp_size=len(decode_ranks)),
            tp_ratio=lambda tp: -tp if tp > 1 else 1,
        )
        self.use_mla = False
        self._has_mamba = False
        self.dst_xfer_side_handles = {DECODE: {r: 100 + r for r in decode_ranks}}
        self._push_finished_blocks: dict[str, Any] = {}
        self._pending_d_registrations: dict[str, Any] = {}
        # Decode side.
        self._pending_completion_notifs: queue.Queue[bytes] = queue.Queue()
        self._recving_metadata: dict[str, Any] = {}
        self._recving_transfers: defaultdict[str, list[int]] = defaultdict(list)
        self.consumer_notification_counts_by_req: defaultdict[str, int] = defaultdict(int)
        self._failed_recv_reqs: queue.Queue[str] = queue.Queue()
        self._is_hma_required = False
        self.kv_cache_config = SimpleNamespace(kv_cache_groups=[object()])
        self.posted: dict[int, int | None] = {}  # rank -> handle _xfer_blocks returns

    def _get_new_notifs(self) -> set[str]:
        """vLLM 0.32's decode path for a completion: count it, report the receive once complete."""
        while True:
            try:
                notif = self._pending_completion_notifs.get_nowait()
            except queue.Empty:
                return set()
            rid, tp = notif.decode().rsplit(":", 1)
            meta = self._recving_metadata.get(rid)
            if meta is None:
                continue
            self.consumer_notification_counts_by_req[rid] += 1
            if self.consumer_notification_counts_by_req[rid] >= meta.pp_size * max(1, int(tp) // self.world_size):
                del self.consumer_notification_counts_by_req[rid]
                self._recving_transfers.setdefault(rid, [])

    def _xfer_blocks(self, read_spec: Any, dst_engine_id: str, request_id: str, remote_request_id: str,
                     local_xfer_side_handle: int, remote_xfer_side_handle: int) -> int | None:  # fmt: skip
        return self.posted.get(read_spec.remote_rank)

    def _handle_push_reg_notif(self, notif: bytes) -> None:
        registration = msgspec.msgpack.decode(notif[len(REG_PREFIX) :])
        self._pending_d_registrations[registration["request_id"]] = registration


get_new_notifs = _push_fail.wrap_get_new_notifs(Worker._get_new_notifs)
xfer_blocks = _push_fail.wrap_xfer_blocks(Worker._xfer_blocks)
handle_reg = _push_fail.wrap_handle_push_reg_notif(Worker._handle_push_reg_notif, REG_PREFIX, base_id)


def write(worker: Worker, rank: int) -> Any:
    return xfer_blocks(
        worker,
        read_spec=SimpleNamespace(remote_rank=rank),
        dst_engine_id=DECODE,
        request_id="p-req-1a2b3c4d",
        remote_request_id="d-req",
        local_xfer_side_handle=1,
        remote_xfer_side_handle=2,
    )


def receiving(producer_tp: int = 1) -> tuple[Worker, int]:
    decode = Worker()
    decode._recving_metadata["d-req"] = SimpleNamespace(pp_size=1, local_block_ids=([7, 8],))
    return decode, producer_tp


def feed(decode: Worker, producer_tp: int, *, failed: bool) -> None:
    body = f"d-req:{producer_tp}".encode()
    decode._pending_completion_notifs.put(_push_fail.PREFIX + body if failed else body)
    get_new_notifs(decode)


def failed(decode: Worker) -> list[str]:
    out = []
    while not decode._failed_recv_reqs.empty():
        out.append(decode._failed_recv_reqs.get_nowait())
    return out


def test_off_by_default(plugin: Any) -> None:
    assert plugin.STATE.applied["push fail"].startswith("off"), plugin.STATE.applied


def test_the_rank_whose_write_was_not_posted_is_told_alone() -> None:
    prefill = Worker(decode_ranks=(0, 1))
    prefill.posted = {0: 1000, 1: None}
    assert write(prefill, 0) == 1000
    assert write(prefill, 1) is None
    assert prefill.nixl_wrapper.sent == [("agent-1", b"PUSH_FAIL:d-req:1")]


def test_a_write_that_raised_is_reported_and_the_error_kept() -> None:
    prefill = Worker()

    def boom(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("push block-count mismatch")

    with pytest.raises(AssertionError):
        _push_fail.wrap_xfer_blocks(boom)(prefill, SimpleNamespace(remote_rank=0), DECODE, "p", "d-req", 1, 2)
    assert prefill.nixl_wrapper.sent == [("agent-0", b"PUSH_FAIL:d-req:1")]


def test_a_push_fail_completes_the_count_and_fails_the_request() -> None:
    decode, tp = receiving()
    feed(decode, tp, failed=True)
    assert failed(decode) == ["d-req"]
    assert "d-req" not in decode._recving_transfers  # never reported received


def test_a_failure_does_not_land_before_a_sibling_write() -> None:
    """Two prefill ranks write here: failing on the first report would free blocks the
    other rank's WRITE may still land in."""
    decode, tp = receiving(producer_tp=2)
    feed(decode, tp, failed=True)
    assert failed(decode) == []
    feed(decode, tp, failed=False)  # the sibling's completion ends the count: failed, not received
    assert failed(decode) == ["d-req"]
    assert "d-req" not in decode._recving_transfers


def test_completions_alone_still_report_the_receive() -> None:
    decode, tp = receiving(producer_tp=2)
    feed(decode, tp, failed=False)
    feed(decode, tp, failed=False)
    assert failed(decode) == [] and "d-req" in decode._recving_transfers


def test_a_push_fail_for_an_unknown_request_is_dropped() -> None:
    decode = Worker()
    decode._pending_completion_notifs.put(b"PUSH_FAIL:gone:1")
    decode._pending_completion_notifs.put(b"other:1")
    get_new_notifs(decode)
    assert failed(decode) == [] and not decode.consumer_notification_counts_by_req


def test_a_hybrid_model_is_left_to_wait() -> None:
    decode, tp = receiving()
    decode.kv_cache_config = SimpleNamespace(kv_cache_groups=[object(), object()])
    feed(decode, tp, failed=True)
    assert failed(decode) == []


def test_a_refused_stale_write_tells_the_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_stale_write, "ON_REFUSE", [_push_fail.refused])
    prefill = Worker(decode_ranks=(0, 1))
    get = _stale_write.wrap_get_transfer_results(lambda self: SimpleNamespace(finished_sending={"p-req-1a2b3c4d"}))
    push = _stale_write.wrap_do_start_push_kv(lambda *args: pytest.fail("a WRITE of released blocks"))
    get(prefill)
    push(prefill, "p-req-1a2b3c4d", ([3, 4],), {"request_id": "d-req", "decode_engine_id": DECODE})
    assert prefill.nixl_wrapper.sent == [("agent-0", b"PUSH_FAIL:d-req:1"), ("agent-1", b"PUSH_FAIL:d-req:1")]


def registration(rid: str) -> bytes:
    return REG_PREFIX + msgspec.msgpack.encode({"request_id": rid, "decode_engine_id": DECODE})


def test_a_registration_after_its_request_was_let_go_is_answered() -> None:
    prefill = Worker()
    _stale_write.wrap_get_transfer_results(lambda self: SimpleNamespace(finished_sending={"chatcmpl-x-1a2b3c4d"}))(
        prefill
    )
    handle_reg(prefill, registration("chatcmpl-x-9f8e7d6c"))
    assert prefill.nixl_wrapper.sent == [("agent-0", b"PUSH_FAIL:chatcmpl-x-9f8e7d6c:1")]
    assert prefill._pending_d_registrations == {}
    # Another request, and one whose finished prefill is still held, go to vLLM as before.
    prefill._push_finished_blocks["chatcmpl-x-11111111"] = ([5],)
    handle_reg(prefill, registration("chatcmpl-x-22222222"))
    handle_reg(prefill, registration("chatcmpl-y-33333333"))
    assert set(prefill._pending_d_registrations) == {"chatcmpl-x-22222222", "chatcmpl-y-33333333"}
    assert len(prefill.nixl_wrapper.sent) == 1


def test_patches_vllms_push_worker_once(vllm_version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if not vllm_version.startswith("0.32"):
        pytest.skip("the push fixes are checked on vLLM 0.32 only")
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker

    names = ("_get_new_notifs", "_xfer_blocks", "_handle_push_reg_notif")
    for name in names:
        monkeypatch.setattr(NixlPushConnectorWorker, name, getattr(NixlPushConnectorWorker, name))
    monkeypatch.setattr(_stale_write, "ON_REFUSE", [])
    # The contract the wrappers rely on.
    params = list(inspect.signature(NixlPushConnectorWorker._xfer_blocks).parameters)
    assert params == [
        "self", "read_spec", "dst_engine_id", "request_id", "remote_request_id",
        "local_xfer_side_handle", "remote_xfer_side_handle",
    ]  # fmt: skip
    assert _push_fail.install().startswith("on")
    patched = [getattr(NixlPushConnectorWorker, name) for name in names]
    assert _push_fail.install().startswith("on")
    assert [getattr(NixlPushConnectorWorker, name) for name in names] == patched
    assert _stale_write.ON_REFUSE[0] is _push_fail.refused
