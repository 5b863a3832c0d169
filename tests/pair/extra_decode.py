"""A second decode vLLM server beside a LocalPD pair, to kill mid-answer (decode migration, issue 15).

Started the way LocalPD starts its servers (``pdclient.local._server.VLLMServer``: the
cached server venv and model, NIXL on CPU buffers, pinned to one core) and warmed up with
one KV handoff from the pair's prefill server, so its NIXL handshake is paid up front.
``kill()`` SIGKILLs its whole process group (the API server and vLLM's engine processes),
as a crashed host would; ``ensure_running()`` starts it again.

(Until LocalPD starts N decode servers itself, ``LocalPD(decode_servers=2)``.)
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Sequence

import httpx

from pdclient import PDChatClient
from pdclient.local import LocalPD, _prepare
from pdclient.local._cpu_isa import cpu_isa_env
from pdclient.local._server import SERVED_MODEL_NAME, VLLMServer, free_port

STARTUP_TIMEOUT = 900.0
# As the session pair (tests/pair/conftest.py): the same parsers, so the same answers.
TOOL_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


class ExtraDecode:
    def __init__(
        self, prefill_url: str, *, cpu: int | None, cpu_isa: str | None = None, extra_args: Sequence[str] = TOOL_ARGS
    ) -> None:
        self.prefill_url = prefill_url
        self.cpu = cpu
        self.cpu_isa = cpu_isa
        """As the pair's (``LocalPD.cpu_isa``): D2's answers are compared with D1's, so it
        computes as D1 does (the same kernels, the same dtype)."""
        self.extra_args = tuple(extra_args)
        self.server: VLLMServer | None = None
        self.starts = 0

    @classmethod
    def beside(cls, prefill_url: str, local: LocalPD | None) -> ExtraDecode:
        """A second decode for the pair whose prefill is at ``prefill_url``, placed and computing
        as that pair's decode when the pair is ``local`` (None: an attached pair, unpinned): on
        the decode's core, since a decode polls while it waits for remote KV and on the
        prefill's core it would starve the very prefill it waits for (whose engine then dies of
        an execute_model timeout); with the pair's ``cpu_isa``, since their answers are compared."""
        if local is None:
            return cls(prefill_url, cpu=None)
        return cls(prefill_url, cpu=local.cpus[-1], cpu_isa=local.cpu_isa)

    @property
    def url(self) -> str:
        assert self.server is not None
        return self.server.base_url + "/v1"

    @property
    def alive(self) -> bool:
        if self.server is None or self.server.pid is None or not self.server.running:
            return False
        try:
            return httpx.get(self.server.base_url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def start(self) -> ExtraDecode:
        workdir = _prepare.cache_dir()
        port = free_port()
        self.server = VLLMServer(
            name="decode2",
            python=_prepare.server_python(),
            model=_prepare.model_dir(),
            port=port,
            log_path=workdir / "logs" / f"decode2-{port}.log",
            workdir=workdir,
            kv_connector="nixl",
            cpu=self.cpu,
            nixl_side_channel_port=free_port(),
            extra_args=self.extra_args,
            env=cpu_isa_env(self.cpu_isa),
        )
        self.server.start()
        try:
            self.server.wait_ready(time.monotonic() + STARTUP_TIMEOUT)
            self._warm_up()
        except BaseException:
            self.server.stop()
            raise
        self.starts += 1
        return self

    def _warm_up(self) -> None:
        with PDChatClient(
            prefill_base_url=self.prefill_url, decode_base_url=self.url, api_key="-", timeout=STARTUP_TIMEOUT
        ) as client:
            client.chat.completions.create(
                model=SERVED_MODEL_NAME, messages=[{"role": "user", "content": "Hello"}], max_tokens=1
            )

    def kill(self) -> None:
        """SIGKILL the server's process group at once (no graceful shutdown), then reap it."""
        assert self.server is not None and self.server.pid is not None
        os.killpg(self.server.pid, signal.SIGKILL)
        self.server.stop()

    def ensure_running(self) -> ExtraDecode:
        if not self.alive:
            if self.server is not None:
                self.server.stop()
            self.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
