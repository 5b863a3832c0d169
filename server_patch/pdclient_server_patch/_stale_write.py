"""A push-mode prefill server refuses to WRITE the blocks of a request it has already let go.

The prefill side of vLLM's ``NixlPushConnector`` matches a finished prefill with the
decode's registration on its ``nixl-push-writer`` thread, and when the handshake with that
decode is not done yet it defers the WRITE to the handshake's completion, keeping the
prefill's block ids. Meanwhile the engine thread may report the request done (its lease
ran out, or a push completed) and the scheduler frees those blocks for other requests. The
deferred WRITE then sends another request's KV into the decode's blocks, and the decode
answers 200 from it. The same holds for a registration matched in the writer's round
after the eviction was queued but before it was read.

``install`` backports the refusal of vLLM PR #55470 (open): the engine thread marks every
request it reports done (``get_transfer_results``'s ``finished_sending``) abandoned before
the scheduler can free its blocks, and the writer checks the mark where a WRITE starts
(``_do_start_push_kv``, the one path of a direct match, a late registration and the
deferred handshake alike), under one lock, so no WRITE of a let-go request is posted after
the mark. The refused decode is not told unless the push-fail notification is on too
(``_push_fail.py``, which hooks into ``ON_REFUSE``): without it, it waits for its WRITE
until its client cuts it, and the push reclaim frees its blocks.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from . import _seams

logger = logging.getLogger("vllm.plugins.pdclient_reuse")

PATCHED = "__pdclient_stale_write__"
# Per worker: request id -> monotonic time to forget it. A late registration for a
# request comes within the decode's wait, far below this.
ABANDONED = "_pdclient_abandoned"
LOCK = "_pdclient_abandoned_lock"
FORGET_AFTER_S = 900.0
# Called with (worker, request id, registration data) for each refused WRITE.
ON_REFUSE: list[Callable[[Any, str, dict[str, Any]], None]] = []


def install() -> str:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
    except ImportError as why:
        return f"skipped (no NixlPushConnector in this vLLM: {why})"
    gone = _seams.missing([(NixlPushConnectorWorker, ("get_transfer_results", "_do_start_push_kv"))])
    if gone:
        return _seams.skipped(gone)
    on = "on (a prefill server posts no WRITE for a request whose lease ended or whose push completed)"
    if getattr(NixlPushConnectorWorker._do_start_push_kv, PATCHED, False):
        return on
    NixlPushConnectorWorker.get_transfer_results = wrap_get_transfer_results(
        NixlPushConnectorWorker.get_transfer_results
    )
    NixlPushConnectorWorker._do_start_push_kv = wrap_do_start_push_kv(NixlPushConnectorWorker._do_start_push_kv)
    return on


def state(worker: Any) -> tuple[threading.RLock, dict[str, float]]:
    # Created on first use from either thread: setdefault on the instance dict is atomic.
    lock = worker.__dict__.setdefault(LOCK, threading.RLock())
    return lock, worker.__dict__.setdefault(ABANDONED, {})


def wrap_get_transfer_results(get: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def get_transfer_results(self: Any) -> Any:
        lock, abandoned = state(self)
        # Held across vLLM's own call: a WRITE the writer starts while this runs waits, and
        # then sees the mark of a request reported here.
        with lock:
            results = get(self)
            now = time.monotonic()
            for rid in results.finished_sending or ():
                abandoned[rid] = now + FORGET_AFTER_S
            for rid, forget_at in list(abandoned.items()):
                if forget_at <= now:
                    del abandoned[rid]
        return results

    return get_transfer_results


def wrap_do_start_push_kv(start: Callable[..., Any]) -> Callable[..., Any]:
    def _do_start_push_kv(self: Any, request_id: str, local_block_ids: Any, registration_data: Any) -> Any:
        lock, abandoned = state(self)
        with lock:
            if request_id not in abandoned:
                return start(self, request_id, local_block_ids, registration_data)
        logger.warning(
            "pdclient_reuse: refusing the push of request %s to decode request %s: its blocks were "
            "released (lease ended or push completed) and may belong to another request",
            request_id,
            (registration_data or {}).get("request_id"),
        )
        # Outside the lock: a hook may send over the network.
        for hook in ON_REFUSE:
            try:
                hook(self, request_id, registration_data)
            except Exception:
                logger.exception("pdclient_reuse: after refusing the push of %s", request_id)
        return None

    setattr(_do_start_push_kv, PATCHED, True)
    return _do_start_push_kv
