"""A test-only vLLM plugin: holds one push-mode WRITE back until its blocks belong to another request.

Never installed: tests/pair/test_push_stale_write.py copies this file beside a
``.dist-info`` naming its ``register`` as a ``vllm.general_plugins`` entry point, and puts
that folder on the servers' PYTHONPATH, so vLLM loads it in every server process like the
real server patch. It runs in the server's venv: it imports nothing of pdclient or tests.

What it does on a prefill server, to the first WRITE started after the test creates the
file ``arm`` in ``PDCLIENT_TEST_PUSH_FAULTS_DIR``: vLLM's ``_do_start_push_kv`` asks
``_ensure_handshake`` for the decode engine, and gets a pending handshake instead of
``None``, so vLLM defers the WRITE to that handshake's completion, as it does when the
handshake with a new decode engine is still running. The handshake completes (the plugin
resolves it) only once the engine has reported that request done (its lease ended) and
another request's finished blocks, which the scheduler ships to the worker, include
some of its blocks: vLLM's own callback then queues the WRITE with the old block ids,
and the writer thread starts it again. Each step is appended to ``events.jsonl`` there,
and so is every WRITE vLLM actually posts (``_xfer_blocks_for_req``) for the held
request: the servers' own record of whether a WRITE went out of blocks it had let go.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

DIR_ENV = "PDCLIENT_TEST_PUSH_FAULTS_DIR"
ARM = "arm"
EVENTS = "events.jsonl"
ENTRY_POINT = "pdclient_test_push_faults"


def register() -> None:
    directory = os.environ.get(DIR_ENV)
    if not directory:
        return
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.push_worker import NixlPushConnectorWorker
    except ImportError:
        return
    if getattr(NixlPushConnectorWorker, "_pdclient_test_faults", False):
        return
    NixlPushConnectorWorker._pdclient_test_faults = True  # type: ignore[attr-defined]
    hold = Hold(Path(directory))
    cls: Any = NixlPushConnectorWorker
    cls._do_start_push_kv = hold.wrap_do_start_push_kv(cls._do_start_push_kv)
    cls._ensure_handshake = hold.wrap_ensure_handshake(cls._ensure_handshake)
    cls.get_transfer_results = hold.wrap_get_transfer_results(cls.get_transfer_results)
    cls.start_load_kv = hold.wrap_start_load_kv(cls.start_load_kv)
    cls._xfer_blocks_for_req = hold.wrap_xfer_blocks_for_req(cls._xfer_blocks_for_req)


def flat(block_ids: Any) -> set[int]:
    """Block ids of every KV cache group, as one set (vLLM passes a tuple of per-group lists)."""
    if block_ids and isinstance(block_ids[0], (list, tuple)):
        return {int(b) for group in block_ids for b in group}
    return {int(b) for b in block_ids or ()}


class Hold:
    """The one held request of a prefill server's worker, and its record."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.lock = threading.Lock()
        self.starting = threading.local()  # the WRITE _do_start_push_kv is starting on this thread
        self.request: str | None = None
        self.blocks: set[int] = set()
        self.handshake: Future[Any] | None = None
        self.reported_done = False

    def record(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "at": time.time(), **fields})
        with self.lock, open(self.directory / EVENTS, "a") as out:
            out.write(line + "\n")

    def wrap_do_start_push_kv(self, start: Any) -> Any:
        def _do_start_push_kv(worker: Any, request_id: str, local_block_ids: Any, registration_data: Any) -> Any:
            self.starting.request = (request_id, local_block_ids, registration_data)
            try:
                return start(worker, request_id, local_block_ids, registration_data)
            finally:
                self.starting.request = None

        return _do_start_push_kv

    def wrap_ensure_handshake(self, ensure: Any) -> Any:
        def _ensure_handshake(worker: Any, *args: Any, **kwargs: Any) -> Any:
            pending = ensure(worker, *args, **kwargs)
            starting = getattr(self.starting, "request", None)
            if pending is not None or starting is None or self.request is not None:
                return pending
            if not (self.directory / ARM).exists():
                return pending
            request_id, blocks, registration = starting
            self.request, self.blocks = request_id, flat(blocks)
            self.handshake = Future()
            self.record(
                "held",
                request=request_id,
                blocks=sorted(self.blocks),
                decode_request=registration.get("request_id"),
            )
            return self.handshake

        return _ensure_handshake

    def wrap_get_transfer_results(self, get: Any) -> Any:
        def get_transfer_results(worker: Any) -> Any:
            results = get(worker)
            if self.request is not None and not self.reported_done and self.request in (results.finished_sending or ()):
                self.reported_done = True
                self.record("reported_done", request=self.request)
            return results

        return get_transfer_results

    def wrap_start_load_kv(self, start: Any) -> Any:
        def start_load_kv(worker: Any, metadata: Any) -> Any:
            result = start(worker, metadata)
            handshake = self.handshake
            if handshake is not None and self.reported_done and not handshake.done():
                for other, blocks in (getattr(metadata, "push_finished_blocks", None) or {}).items():
                    taken = self.blocks & flat(blocks)
                    if other != self.request and taken:
                        self.record("reused", request=self.request, by=other, blocks=sorted(taken))
                        # vLLM's callback on this "handshake" queues the held WRITE for the writer.
                        handshake.set_result(({}, 0.0))
                        self.record("released", request=self.request)
                        break
            return result

        return start_load_kv

    def wrap_xfer_blocks_for_req(self, xfer: Any) -> Any:
        def _xfer_blocks_for_req(worker: Any, req_id: str, meta: Any) -> Any:
            if req_id == self.request:
                self.record(
                    "written",
                    request=req_id,
                    blocks=sorted(flat(meta.local_block_ids)),
                    decode_request=meta.remote.request_id,
                )
            return xfer(worker, req_id, meta)

        return _xfer_blocks_for_req
