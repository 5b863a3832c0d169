"""A push-mode decode aborted while it waits for remote KV gets its blocks back.

vLLM's scheduler frees the blocks of a request aborted in ``WAITING_FOR_REMOTE_KVS`` only
when the worker reports the receive finished (``Scheduler.finish_requests`` delays the
free): a transfer still landing must not write into the blocks' next owner. In push mode
(``NixlPushConnector``) only the prefill server's WRITE produces that report, and the
decode side has no lease of its own. After a prefill that fails for good (its server
died, the call was cut before it ran) no WRITE comes, and the blocks stay held for the
life of the engine, whose loop also keeps stepping for the held request.

``install`` backports the design of vLLM PR #46289 (open; vLLM issue #46283), limited to
push-mode connectors:

- an abort that leaves a waiting push-mode decode's blocks held arms a reclaim deadline
  of the connector's ``kv_lease_duration`` plus ``grace_s``. A prefill server WRITEs only
  while it holds its own blocks, that is until its lease ends (heartbeats stop with the
  abort, and extend the lease by less than its length), so past the deadline no WRITE
  from a prefill that had finished by the abort can still land;
- each scheduler step frees the held blocks whose deadline passed;
- the decode worker forgets the receive (``_recving_metadata``), so a completion that
  still arrives is logged as unrecognized instead of being reported for a request the
  scheduler no longer has, and the scheduler drops such a late report instead of
  failing its assertion.

What it cannot see: a prefill that had not finished by the abort and finishes more than
the lease plus ``grace_s`` later still WRITEs into blocks that may belong to another
request by then. pdclient's concurrent dispatch reads a prefill whose decode it cut for
at most its ``prefill_timeout`` and then closes it (vLLM aborts an unanswered prefill,
which never WRITEs), so the lease plus ``grace_s`` must stay above that timeout.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import _seams

logger = logging.getLogger("vllm.plugins.pdclient_reuse")

PATCHED = "__pdclient_push_reclaim__"
# Per scheduler instance: request id -> monotonic deadline of its reclaim.
DEADLINES = "_pdclient_reclaim_deadlines"
# Per scheduler instance: reclaimed request id -> monotonic time to forget it.
RECLAIMED = "_pdclient_reclaimed"
# Per push connector scheduler: ids reclaimed since its last metadata, for the workers.
TO_FORGET = "_pdclient_reclaimed_to_forget"
# Attribute of the connector metadata the decode workers read.
META_ATTR = "pdclient_reclaimed"
_NO_LEASE = -1.0
TOMBSTONE_S = 600.0


def install(grace_s: float) -> str:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_scheduler import (
            NixlPushConnectorScheduler,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.request import RequestStatus
    except ImportError as why:
        return f"skipped (no NixlPushConnector in this vLLM: {why})"
    gone = _seams.missing(
        [
            (Scheduler, ("finish_requests", "update_from_output", "_update_from_kv_xfer_finished", "_free_blocks")),
            (NixlPushConnectorScheduler, ("build_connector_meta",)),
            (NixlPushConnectorWorker, ("start_load_kv",)),
        ]
    )
    if not hasattr(RequestStatus, "WAITING_FOR_REMOTE_KVS"):
        gone.append("RequestStatus.WAITING_FOR_REMOTE_KVS")
    if gone:
        return _seams.skipped(gone)
    on = (
        f"on (a push-mode decode aborted while waiting for its KV frees its blocks kv_lease_duration + {grace_s:g} s"
        " after the abort; late completions for it are dropped)"
    )
    if getattr(Scheduler.finish_requests, PATCHED, None) is not None:
        return on
    waiting = RequestStatus.WAITING_FOR_REMOTE_KVS
    Scheduler.finish_requests = wrap_finish_requests(Scheduler.finish_requests, waiting, grace_s)
    Scheduler.update_from_output = wrap_update_from_output(Scheduler.update_from_output)
    Scheduler._update_from_kv_xfer_finished = wrap_update_from_kv_xfer_finished(Scheduler._update_from_kv_xfer_finished)
    NixlPushConnectorScheduler.build_connector_meta = wrap_build_connector_meta(
        NixlPushConnectorScheduler.build_connector_meta
    )
    NixlPushConnectorWorker.start_load_kv = wrap_start_load_kv(NixlPushConnectorWorker.start_load_kv)
    return on


def push_scheduler(scheduler: Any) -> Any | None:
    """The push connector's scheduler side behind ``scheduler.connector`` (MultiConnector
    children included), or None where the KV does not move in push mode."""
    connector = getattr(scheduler, "connector", None)
    if connector is None:
        return None
    for candidate in (connector, *getattr(connector, "_connectors", ())):
        side = getattr(candidate, "connector_scheduler", None)
        if getattr(side, "_TRANSFER_MODE", None) == "push" and hasattr(side, "_kv_lease_duration"):
            return side
    return None


def _lease_s(scheduler: Any) -> float:
    cached = scheduler.__dict__.get("_pdclient_push_lease_s")
    if cached is None:
        side = push_scheduler(scheduler)
        cached = float(side._kv_lease_duration) if side is not None else _NO_LEASE
        scheduler.__dict__["_pdclient_push_lease_s"] = cached
    return float(cached)


def wrap_finish_requests(finish: Callable[..., Any], waiting: Any, grace_s: float) -> Callable[..., Any]:
    def finish_requests(self: Any, request_ids: Any, finished_status: Any) -> Any:
        lease_s = _lease_s(self)
        if lease_s == _NO_LEASE:
            return finish(self, request_ids, finished_status)
        if isinstance(request_ids, str):
            ids: Iterable[str] = (request_ids,)
        elif request_ids is None:
            ids = list(self.requests)
        else:
            # The caller may pass a one-shot iterable: read it once, hand vLLM the copy.
            ids = request_ids = list(request_ids)
        held = [
            rid
            for rid in ids
            if (request := self.requests.get(rid)) is not None
            and request.status == waiting
            and rid not in self.finished_recving_kv_req_ids
        ]
        result = finish(self, request_ids, finished_status)
        if held:
            deadline = time.monotonic() + lease_s + grace_s
            deadlines = self.__dict__.setdefault(DEADLINES, {})
            for rid in held:
                if rid in self.requests:  # its free was delayed, as expected
                    deadlines[rid] = deadline
                    logger.info(
                        "pdclient_reuse: request %s aborted while waiting for pushed KV; its blocks are "
                        "reclaimed in %.0f s unless its transfer ends first (a WRITE, or the prefill's PUSH_FAIL)",
                        rid,
                        lease_s + grace_s,
                    )
        return result

    setattr(finish_requests, PATCHED, grace_s)
    return finish_requests


def wrap_update_from_output(update: Callable[..., Any]) -> Callable[..., Any]:
    def update_from_output(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Before the step's own work: the stats it returns then show the blocks freed. An
        # engine left with no request steps no more, and /metrics keeps the last stats.
        if self.__dict__.get(DEADLINES) or self.__dict__.get(RECLAIMED):
            reclaim_expired(self)
        return update(self, *args, **kwargs)

    return update_from_output


def reclaim_expired(scheduler: Any, now: float | None = None) -> list[str]:
    """Free the held blocks whose deadline passed; forget tombstones past theirs."""
    now = time.monotonic() if now is None else now
    deadlines: dict[str, float] = scheduler.__dict__.setdefault(DEADLINES, {})
    reclaimed: dict[str, float] = scheduler.__dict__.setdefault(RECLAIMED, {})
    freed = []
    for rid, deadline in list(deadlines.items()):
        request = scheduler.requests.get(rid)
        if request is None:  # the transfer ended (a WRITE, a PUSH_FAIL) and vLLM freed the blocks itself
            del deadlines[rid]
            logger.info("pdclient_reuse: request %s: its transfer ended, vLLM freed its blocks; no reclaim", rid)
            continue
        if deadline > now:
            continue
        del deadlines[rid]
        if not request.is_finished():  # not the aborted request any more: leave it alone
            continue
        scheduler._free_blocks(request)
        freed.append(rid)
        # The decode workers forget the receive with the next step's metadata; a completion
        # they computed before that is still known to be late.
        reclaimed[rid] = now + TOMBSTONE_S
    for rid, forget_at in list(reclaimed.items()):
        if forget_at <= now:
            del reclaimed[rid]
    if freed:
        side = push_scheduler(scheduler)
        if side is not None:
            side.__dict__.setdefault(TO_FORGET, set()).update(freed)
        logger.warning(
            "pdclient_reuse: reclaimed the KV blocks of %d push-mode request(s) aborted while waiting for a "
            "WRITE that never came: %s",
            len(freed),
            ", ".join(freed),
        )
    return freed


def wrap_update_from_kv_xfer_finished(update: Callable[..., Any]) -> Callable[..., Any]:
    def _update_from_kv_xfer_finished(self: Any, kv_connector_output: Any) -> Any:
        reclaimed = self.__dict__.get(RECLAIMED)
        if reclaimed:
            late = {
                field: {rid for rid in ids if rid in reclaimed and rid not in self.requests}
                for field in ("finished_recving", "finished_sending")
                if (ids := getattr(kv_connector_output, field, None))
            }
            late = {field: ids for field, ids in late.items() if ids}
            if late:
                logger.warning(
                    "pdclient_reuse: ignoring a late transfer completion for reclaimed request(s) %s",
                    ", ".join(sorted(set().union(*late.values()))),
                )
                kv_connector_output = dataclasses.replace(
                    kv_connector_output,
                    **{field: set(getattr(kv_connector_output, field)) - ids for field, ids in late.items()},
                )
        return update(self, kv_connector_output)

    return _update_from_kv_xfer_finished


def wrap_build_connector_meta(build: Callable[..., Any]) -> Callable[..., Any]:
    def build_connector_meta(self: Any, *args: Any, **kwargs: Any) -> Any:
        meta = build(self, *args, **kwargs)
        forget = self.__dict__.pop(TO_FORGET, None)
        if forget:
            setattr(meta, META_ATTR, set(forget))
        return meta

    return build_connector_meta


def wrap_start_load_kv(start: Callable[..., Any]) -> Callable[..., Any]:
    def start_load_kv(self: Any, metadata: Any) -> Any:
        for rid in getattr(metadata, META_ATTR, ()):
            # Without its receive metadata, a completion that still arrives takes vLLM's
            # "unrecognized request notif" path: logged, not reported to the scheduler.
            for state in ("_recving_metadata", "_recving_transfers", "consumer_notification_counts_by_req"):
                getattr(self, state, {}).pop(rid, None)
        return start(self, metadata)

    return start_load_kv
