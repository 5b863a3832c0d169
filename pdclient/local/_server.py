"""One vLLM OpenAI server as a child process: launch, wait until it answers, stop.

The server runs from the cached server venv (see ``_prepare``), never in the caller's
process: vLLM pins its own torch and openai. Each server gets its own process group so
that stopping it also stops the engine-core and worker processes vLLM forks.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from .._errors import PDSetupError
from ._cpu_isa import EMULATED_ISA_ENV, server_dtype
from ._logscan import LogScanner
from ._ports import HOST, claim_ports

logger = logging.getLogger("pdclient.local")

SERVED_MODEL_NAME = "smollm2"

# kv_both: every server can send and receive KV, so one config serves either role.
# kv_buffer_device cpu: NIXL moves the KV between host buffers (there is no GPU here).
# kv_lease_duration: how long the prefill keeps a request's KV for the decode to pull
# (vLLM default 30 s). On a contended 2-core machine a decode leg can start later than
# that; the prefill then frees blocks the decode may still read ("Potentially invalid KV
# blocks ... may have expired" in its log). Two minutes covers it.
NIXL_KV_TRANSFER_CONFIG: dict[str, Any] = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_connector_extra_config": {"kv_lease_duration": 120},
}
# Push mode (vLLM 0.32's NixlPushConnector): the decode server registers its freshly
# allocated blocks with the prefill server, which WRITEs the KV into them as its prefill
# ends, so a client may send both legs at once (``PDOptions.dispatch``). Same settings
# otherwise. push_registration_timeout: how long a decode waits for a WRITE that never
# comes (a prefill that failed or was cancelled) before its server fails it; the client
# aborts such a decode itself, this is the backstop (vLLM's default is 480 s).
NIXL_PUSH_KV_TRANSFER_CONFIG: dict[str, Any] = {
    **NIXL_KV_TRANSFER_CONFIG,
    "kv_connector": "NixlPushConnector",
    "kv_connector_extra_config": {"kv_lease_duration": 120, "push_registration_timeout": 60},
}
KV_CONNECTORS: dict[str, dict[str, Any]] = {
    "nixl": NIXL_KV_TRANSFER_CONFIG,
    "nixl-push": NIXL_PUSH_KV_TRANSFER_CONFIG,
    # vLLM's own class names, as --kv-transfer-config spells them.
    "NixlConnector": NIXL_KV_TRANSFER_CONFIG,
    "NixlPushConnector": NIXL_PUSH_KV_TRANSFER_CONFIG,
}
NIXL_CONNECTORS = frozenset(KV_CONNECTORS)
"""Every name above moves the KV over NIXL: each server needs its own side-channel port."""

_STOP_GRACE_S = 20.0
_POLL_S = 0.5


def free_port() -> int:
    """A loopback port outside the kernel's ephemeral range, free now (see ``_ports``).

    Not claimed: for a port a test binds at once, or one where nothing must listen.
    LocalPD claims its own ports with ``_ports.claim_ports`` until the pair stops.
    """
    (claim,) = claim_ports(1)
    claim.release()
    return claim.port


def check_port_free(port: int, what: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((HOST, port))
        except OSError as exc:
            raise PDSetupError(
                f"{what} port {HOST}:{port} is in use ({exc.strerror}); pick another port or stop what holds it"
            ) from None


class ServerStartError(PDSetupError):
    """A server exited, or logged a fatal error, while starting or warming up."""

    def __init__(self, message: str, *, port_collision: bool, ports: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.port_collision = port_collision
        """The log says a port it was given was taken: a start with other ports may work."""
        self.ports = ports
        """The ports the offending line names, where it names them."""


def _tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


KV_EVENTS_TOPIC = "kv"


class VLLMServer:
    """A ``vllm.entrypoints.openai.api_server`` child process on ``HOST:port``."""

    def __init__(
        self,
        *,
        name: str,
        python: Path,
        model: Path,
        port: int,
        log_path: Path,
        workdir: Path,
        kv_connector: str | None,
        cpu: int | None,
        nixl_side_channel_port: int | None = None,
        kv_event_ports: tuple[int, int] | None = None,
        max_model_len: int = 2048,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
    ) -> None:
        if kv_connector is not None and kv_connector not in KV_CONNECTORS:
            raise PDSetupError(
                f"unknown kv_connector {kv_connector!r}; expected one of {sorted(KV_CONNECTORS)} or None"
            )
        self.name = name
        self.port = port
        self.nixl_side_channel_port = nixl_side_channel_port
        self.kv_event_ports = kv_event_ports
        """(publisher, replay) ports of its KV events, or None when it publishes none."""
        self.log_path = log_path
        self.kv_connector = kv_connector
        self._workdir = workdir
        self._proc: subprocess.Popen[bytes] | None = None
        self._pid: int | None = None
        self._started_at = 0.0
        self._scanner = LogScanner(log_path)

        self.argv = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model),
            "--served-model-name", SERVED_MODEL_NAME,
            "--host", HOST,
            "--port", str(port),
            "--max-model-len", str(max_model_len),
            "--dtype", server_dtype((env or {}).get(EMULATED_ISA_ENV)),
            # Eager starts in ~35 s; compiled takes 2-3 min every start (its cache does not reload).
            "--enforce-eager",
            # usage.prompt_tokens_details (cached tokens): what the client's usage merge reports.
            "--enable-prompt-tokens-details",
        ]  # fmt: skip
        if kv_connector is not None:
            self.argv += ["--kv-transfer-config", json.dumps(KV_CONNECTORS[kv_connector])]
        if kv_event_ports is not None:
            publisher, replay = kv_event_ports
            # "*": vLLM binds an address with a wildcard, and connects to one with a host.
            config = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{publisher}",
                "replay_endpoint": f"tcp://*:{replay}",
                "topic": KV_EVENTS_TOPIC,
            }
            self.argv += ["--kv-events-config", json.dumps(config)]
        self.argv += list(extra_args)

        push = kv_connector is not None and KV_CONNECTORS[kv_connector] is NIXL_PUSH_KV_TRANSFER_CONFIG
        # A push-mode decode registered before its prefill ran steps its engine every
        # millisecond for the whole prefill, on any core, the prefill's included: server_patch
        # makes such an idle engine wait up to 10 ms between steps. A pull-mode decode waits
        # for its KV only milliseconds, so its engine loop is left as vLLM ships it.
        # vLLM 0.32 keeps the blocks of a push-mode decode aborted while it waits for a
        # WRITE (a prefill that failed for good) until the engine stops: server_patch frees
        # them once the prefill's lease (120 s) and 10 s more have passed, which is past
        # the client's prefill_timeout (60 s), after which no prefill of a cut decode runs.
        # And a prefill server posts no WRITE of blocks it has already let go, and tells
        # a decode it posts no WRITE for, which then fails the request instead of waiting.
        push_env = (
            {
                "PDCLIENT_IDLE_WAIT_MS": "10",
                "PDCLIENT_PUSH_RECLAIM_GRACE_S": "10",
                "PDCLIENT_PUSH_REFUSE_STALE_WRITE": "1",
                "PDCLIENT_PUSH_FAIL_NOTIFY": "1",
            }
            if push
            else {}
        )
        self.env = self._build_env(cpu, nixl_side_channel_port, workdir, {**push_env, **(env or {})})

    @staticmethod
    def _build_env(
        cpu: int | None, side_channel_port: int | None, workdir: Path, extra: Mapping[str, str]
    ) -> dict[str, str]:
        env = dict(os.environ)
        # The server venv must see only its own packages, not the caller's (dev venv, checkout).
        for key in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV"):
            env.pop(key, None)
        env.update(
            {
                # GiB of KV cache; ~45k tokens of SmolLM2-135M, plenty for tests and benchmarks.
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "VLLM_CACHE_ROOT": str(workdir / "vllm-cache"),
                "TORCHINDUCTOR_CACHE_DIR": str(workdir / "torchinductor"),
                # NIXL's progress thread spins a core by default, the core the model runs on
                # here; server_patch makes it sleep 1 ms between rounds (prefill 3-5x faster).
                "PDCLIENT_NIXL_PROGRESS_DELAY_US": "1000",
            }
        )
        if cpu is not None:
            # Both servers bind core 0 by default; two models computing on one core make
            # each other several times slower. vLLM's NIXL worker then moves its thread
            # (the one that runs the model) to the machine's last core: server_patch keeps
            # it on this one.
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(cpu)
            env["PDCLIENT_NIXL_KV_CPUS"] = str(cpu)
        if side_channel_port is not None:
            env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel_port)
        env.update(extra)
        return env

    @property
    def base_url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """The server's process id (also after stop(), to check it is gone)."""
        return self._pid

    @property
    def running(self) -> bool:
        """Started and not stopped (it may still be starting, or have crashed since)."""
        return self._proc is not None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting %s server on %s:%d (log: %s)", self.name, HOST, self.port, self.log_path)
        with open(self.log_path, "wb") as log:
            log.write(f"$ {' '.join(self.argv)}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                # Not the checkout: `python -m` puts cwd on sys.path, and a server_patch/
                # folder there would shadow the installed plugin.
                cwd=self._workdir,
                # Own process group: Ctrl-C in a terminal does not reach it half-way, and
                # stop() can signal vLLM's forked engine processes along with it.
                start_new_session=True,
            )
        self._pid = self._proc.pid
        self._started_at = time.monotonic()
        self._scanner = LogScanner(self.log_path)

    @property
    def ports(self) -> str:
        """The ports this server binds, for messages."""
        side = f", NIXL side channel {self.nixl_side_channel_port}" if self.nixl_side_channel_port else ""
        return f"API port {self.port}{side}"

    def check(self, doing: str = "starting") -> None:
        """Raises ServerStartError if the process has exited or its log shows a fatal error.

        Cheap (a waitpid and a read of what the log gained since the last call): call it
        every poll while the server starts and while it serves the warm-up.
        """
        assert self._proc is not None, "start() first"
        code = self._proc.poll()
        fatal = self._scanner.scan()  # after the poll: an exited server's last words are in the file
        if code is None and fatal is None:
            return
        what = f"exited with code {code}" if code is not None else "logged a fatal error"
        line = f"\n  offending line: {fatal}" if fatal is not None else ""
        raise ServerStartError(
            f"{self.name} server {what} while {doing} ({self.ports}); log: {self.log_path}{line}\n"
            f"--- last lines ---\n{_tail(self.log_path)}",
            port_collision=fatal is not None and fatal.port_collision,
            ports=fatal.ports if fatal is not None else frozenset(),
        )

    def poll_ready(self, client: httpx.Client) -> bool:
        """True once /health and /v1/models answer; ServerStartError if it died or logged a fatal error."""
        self.check()
        try:
            if client.get(f"{self.base_url}/health").status_code != 200:
                return False
            return client.get(f"{self.base_url}/v1/models").status_code == 200
        except httpx.TransportError:
            return False

    def wait_ready(self, deadline: float) -> None:
        wait_all_ready([self], deadline)

    def timeout_error(self) -> PDSetupError:
        return PDSetupError(
            f"{self.name} server did not answer /health within the startup timeout ({self.ports}); "
            f"log: {self.log_path}\n--- last lines ---\n{_tail(self.log_path)}"
        )

    @property
    def seconds_since_start(self) -> float:
        return time.monotonic() - self._started_at

    def stop(self, grace: float = _STOP_GRACE_S) -> None:
        """SIGTERM the process group, SIGKILL what is left after ``grace`` seconds. Idempotent."""
        stop_all([self], grace)

    def _terminate(self) -> subprocess.Popen[bytes] | None:
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            logger.info("stopping %s server (pid %d)", self.name, proc.pid)
        # Signal the group even when the leader is gone: its engine processes may linger.
        _signal_group(proc.pid, signal.SIGTERM)
        return proc

    def _kill(self, proc: subprocess.Popen[bytes], deadline: float) -> None:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("%s server ignored SIGTERM; killing it", self.name)
        _signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def stop_all(servers: Sequence[VLLMServer], grace: float = _STOP_GRACE_S) -> None:
    """Stops the servers together: SIGTERM to all, one shared grace period, then SIGKILL.

    A server wedged at startup (an engine waiting for a dead NIXL listener) ignores
    SIGTERM; stopping one after the other would wait the grace period once per server.
    """
    procs = [(srv, srv._terminate()) for srv in servers]
    deadline = time.monotonic() + grace
    for srv, proc in procs:
        if proc is not None:
            srv._kill(proc, deadline)


def wait_all_ready(servers: Sequence[VLLMServer], deadline: float) -> None:
    """Waits until every server answers, checking all of them (process and log) every poll.

    A server that dies or logs a fatal error fails the wait at once, whichever server is
    still loading: nothing waits for the timeout on a server that will never answer.
    """
    pending = list(servers)
    with httpx.Client(timeout=5.0) as client:
        while True:
            for srv in servers:
                srv.check()
            for srv in list(pending):
                if srv.poll_ready(client):
                    pending.remove(srv)
                    logger.info("%s server ready in %.1f s", srv.name, srv.seconds_since_start)
            if not pending:
                return
            if time.monotonic() > deadline:
                raise pending[0].timeout_error()
            time.sleep(_POLL_S)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, sig)
