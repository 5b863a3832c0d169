"""A push-mode prefill server tells the decode when it posts no WRITE, and the decode stops waiting.

vLLM 0.32's decode knows its pushed KV has arrived by counting the completion
notifications its WRITEs carry, one per prefill rank writing to it. A WRITE that is
never posted carries none: a submission that failed, a WRITE the stale-write refusal
refused, a registration that came after the prefill server let the request go. The
decode then waits for KV that never comes, holding its blocks, until its client cuts it.

``install`` backports vLLM PR #50754's notification (open). Its wire format: the prefill
worker sends ``PUSH_FAIL:<decode request id>:<prefill world size>`` over NIXL to each
decode rank it owes a WRITE, in place of that WRITE's completion (``<decode request
id>:<world size>``). The decode counts it with the completions, so a partly posted
push still completes its count once the posted WRITEs have landed; when the count is
complete and one of them was a ``PUSH_FAIL``, the decode fails the receive the way vLLM
fails one whose handshake failed (``_failed_recv_reqs``), and the scheduler applies
``kv_load_failure_policy`` (``fail``, vLLM 0.32's default: the caller gets an error;
``recompute``: the decode computes the prompt itself). As upstream, a hybrid or
multi-group model, or a receive without blocks, is left to wait (its blocks could not
be invalidated).

Sent where a WRITE submission posted nothing (``_xfer_blocks``, upstream's case), and,
with the stale-write refusal on, where it refuses a WRITE and for a registration that
arrives after the prefill server let its request go (matched by vLLM's base request id,
only when no finished prefill would match it). Both servers need the switch: a decode
without it logs the message as an unrecognized notification and keeps waiting, as
before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from . import _seams

logger = logging.getLogger("vllm.plugins.pdclient_reuse")

PREFIX = b"PUSH_FAIL:"
PATCHED = "__pdclient_push_fail__"
# Per decode worker: receives a PUSH_FAIL was counted for, until their count completes.
FLAGGED = "_pdclient_push_failed"


def install() -> str:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.utils import get_base_request_id
    except ImportError as why:
        return f"skipped (no NixlPushConnector in this vLLM: {why})"
    gone = _seams.missing(
        [
            (
                NixlPushConnectorWorker,
                ("_get_new_notifs", "_xfer_blocks", "_handle_push_reg_notif", "_pop_matching_finished_blocks"),
            )
        ]
    )
    if gone:
        return _seams.skipped(gone)
    on = "on (a prefill server that posts no WRITE tells the decode, which fails the request instead of waiting)"
    if getattr(NixlPushConnectorWorker._get_new_notifs, PATCHED, False):
        return on
    cls: Any = NixlPushConnectorWorker
    cls._get_new_notifs = wrap_get_new_notifs(cls._get_new_notifs)
    cls._xfer_blocks = wrap_xfer_blocks(cls._xfer_blocks)
    cls._handle_push_reg_notif = wrap_handle_push_reg_notif(
        cls._handle_push_reg_notif, PUSH_REG_NOTIF_PREFIX, get_base_request_id
    )
    from . import _stale_write

    _stale_write.ON_REFUSE[:] = [refused]
    return on


def message(decode_request_id: str, world_size: int) -> bytes:
    return PREFIX + f"{decode_request_id}:{world_size}".encode()


def write_ranks(worker: Any, engine_id: str) -> list[int]:
    """The decode ranks this prefill worker WRITEs a request to, as vLLM 0.32's
    ``_xfer_blocks_for_req`` picks them; empty before the handshake with that decode."""
    plan = worker.tp_mappings.get(engine_id)
    if plan is None or worker.transfer_topo is None:
        return []
    remote_tp = worker.transfer_topo.get_engine_info(engine_id).remote_tp_size
    if worker.use_mla and worker.transfer_topo.tp_ratio(remote_tp) < 0 and not worker._has_mamba:
        return sorted(worker.dst_xfer_side_handles[engine_id])
    return list(plan.all_source_ranks)


def notify(worker: Any, engine_id: str, decode_request_id: str, ranks: Iterable[int], why: str) -> None:
    """Send ``PUSH_FAIL`` to those ranks of the decode engine. Best effort: a rank that cannot
    be told keeps waiting, as without the notification."""
    with worker._handshake_lock:
        agents = dict(worker._remote_agents.get(engine_id) or {})
    payload = message(decode_request_id, worker.world_size)
    for rank in ranks:
        # A push target is handshaken with pipeline parallel size 1.
        agent = agents.get((0, rank))
        if agent is None:
            logger.error(
                "pdclient_reuse: cannot tell rank %d of decode engine %s that request %s gets no WRITE (%s)",
                rank,
                engine_id,
                decode_request_id,
                why,
            )
            continue
        try:
            worker.nixl_wrapper.send_notif(agent, notif_msg=payload)
        except Exception:
            logger.exception("pdclient_reuse: sending PUSH_FAIL for %s to rank %d failed", decode_request_id, rank)
        else:
            logger.warning(
                "pdclient_reuse: told rank %d of decode engine %s that request %s gets no WRITE (%s)",
                rank,
                engine_id,
                decode_request_id,
                why,
            )


def refused(worker: Any, request_id: str, registration_data: dict[str, Any]) -> None:
    """The stale-write refusal's hook: the refused decode gets its PUSH_FAIL."""
    engine_id = registration_data["decode_engine_id"]
    notify(
        worker,
        engine_id,
        registration_data["request_id"],
        write_ranks(worker, engine_id),
        f"the push of {request_id} was refused: its blocks were released",
    )


def wrap_xfer_blocks(xfer: Any) -> Any:
    def _xfer_blocks(
        self: Any,
        read_spec: Any,
        dst_engine_id: str,
        request_id: str,
        remote_request_id: str,
        local_xfer_side_handle: int,
        remote_xfer_side_handle: int,
    ) -> Any:
        handle = None
        try:
            handle = xfer(
                self,
                read_spec=read_spec,
                dst_engine_id=dst_engine_id,
                request_id=request_id,
                remote_request_id=remote_request_id,
                local_xfer_side_handle=local_xfer_side_handle,
                remote_xfer_side_handle=remote_xfer_side_handle,
            )
        finally:
            if handle is None:
                notify(
                    self,
                    dst_engine_id,
                    remote_request_id,
                    (read_spec.remote_rank,),
                    f"the WRITE of {request_id} was not posted",
                )
        return handle

    return _xfer_blocks


def wrap_handle_push_reg_notif(handle: Any, prefix: bytes, base_id: Callable[[str], str]) -> Any:
    import msgspec

    from . import _stale_write

    def _handle_push_reg_notif(self: Any, notif: bytes) -> None:
        lock, abandoned = _stale_write.state(self)
        if abandoned:
            try:
                registration = msgspec.msgpack.decode(notif[len(prefix) :])
                rid = registration["request_id"]
                engine_id = registration["decode_engine_id"]
            except Exception:
                return handle(self, notif)  # vLLM logs what it cannot read
            base = base_id(rid)
            with lock:
                gone = next((p for p in abandoned if base_id(p) == base), None)
            # A finished prefill it matches is still held: vLLM pushes it as usual.
            live = any(base_id(p) == base for p in self._push_finished_blocks)
            if gone is not None and not live:
                notify(
                    self,
                    engine_id,
                    rid,
                    write_ranks(self, engine_id),
                    f"it registered after {gone} was let go",
                )
                return None
        return handle(self, notif)

    return _handle_push_reg_notif


def wrap_get_new_notifs(get: Any) -> Any:
    import queue

    def _get_new_notifs(self: Any) -> set[str]:
        flagged: set[str] = self.__dict__.setdefault(FLAGGED, set())
        inbox = self._pending_completion_notifs
        others = []
        while True:
            try:
                notif = inbox.get_nowait()
            except queue.Empty:
                break
            if notif.startswith(PREFIX):
                _count_failure(self, notif[len(PREFIX) :].decode(), flagged)
            else:
                others.append(notif)
        for notif in others:
            inbox.put(notif)
        done = get(self)
        # A push whose count the completions of its posted WRITEs finished: vLLM has
        # reported it received; it failed.
        for rid in [r for r in flagged if r in self._recving_transfers]:
            if rid not in self.consumer_notification_counts_by_req:
                flagged.discard(rid)
                self._recving_transfers.pop(rid, None)
                _fail(self, rid)
        return done

    setattr(_get_new_notifs, PATCHED, True)
    return _get_new_notifs


def _count_failure(worker: Any, body: str, flagged: set[str]) -> None:
    rid, _, tp = body.rpartition(":")
    meta = worker._recving_metadata.get(rid)
    if meta is None or not tp.isdigit():
        logger.error("pdclient_reuse: PUSH_FAIL for unknown request %r (done, reclaimed or never here)", rid)
        return
    expected = meta.pp_size * max(1, int(tp) // worker.world_size)
    counts = worker.consumer_notification_counts_by_req
    counts[rid] += 1
    if counts[rid] < expected:
        flagged.add(rid)
        return
    del counts[rid]
    flagged.discard(rid)
    _fail(worker, rid)


def _fail(worker: Any, rid: str) -> None:
    meta = worker._recving_metadata.get(rid)
    if worker._is_hma_required or len(worker.kv_cache_config.kv_cache_groups) > 1:
        reason = "a hybrid or multi-group model's blocks cannot be invalidated"
    elif meta is None or not any(meta.local_block_ids):
        reason = "it has no blocks to invalidate"
    else:
        logger.warning("pdclient_reuse: request %s gets no WRITE from its prefill server; failing its KV load", rid)
        worker._failed_recv_reqs.put(rid)
        return
    logger.error("pdclient_reuse: request %s gets no WRITE, but %s; it waits until it is aborted", rid, reason)
