"""LocalPD's own failure modes: clear errors, nothing left running."""

from __future__ import annotations

import logging
import os
import re
import socket
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from pdclient import PDSetupError
from pdclient.local import LocalPD, PDServers
from pdclient.local._pair import assign_cpus
from pdclient.local._server import VLLMServer, free_port
from pdclient.wire import PREFILL_KV_TRANSFER_PARAMS

from .helpers import metric


def test_port_in_use_is_a_clear_error() -> None:
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        started = time.monotonic()
        with (
            pytest.raises(PDSetupError, match=rf"decode port 127\.0\.0\.1:{port} is in use"),
            LocalPD(decode_port=port),
        ):
            pass
    assert time.monotonic() - started < 5


def test_server_that_exits_names_its_log_and_nothing_is_left_running() -> None:
    pd = LocalPD(extra_server_args=["--no-such-vllm-flag"], startup_timeout=120)
    with pytest.raises(PDSetupError) as info:
        pd.start()
    message = str(info.value)
    assert "server exited with code" in message and ".log" in message
    assert "no-such-vllm-flag" in message  # the log's last lines carry vLLM's own complaint
    pids = [srv.pid for srv in (pd.prefill, pd.decode) if srv is not None and srv.pid is not None]
    assert len(pids) == 2
    assert not any(_alive(pid) for pid in pids)


def test_a_taken_side_channel_port_fails_within_seconds_naming_server_log_and_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The NIXL side-channel port is taken before the server binds it.

    Both servers get a side-channel port this test holds (``server_env`` overrides
    LocalPD's choice): each handshake listener thread dies with ``Address already in
    use``, the engine waits for it forever and /health never answers. start() fails as
    soon as the line is in the log, and at once: the port is the caller's, which a start
    with new ports would give the servers again, so it does not start again.
    """
    caplog.set_level(logging.WARNING, logger="pdclient.local")
    port = free_port()
    with socket.create_server(("127.0.0.1", port)):
        pd = LocalPD(server_env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(port)}, startup_timeout=600)
        started = time.monotonic()
        with pytest.raises(PDSetupError) as info:
            pd.start()
        failed_at, elapsed = datetime.now(), time.monotonic() - started
    message = str(info.value)
    assert re.search(
        r"^(prefill|decode) server logged a fatal error while starting \(API port \d+, NIXL side channel \d+\)", message
    )
    offending = f"zmq.error.ZMQError: Address already in use (addr='tcp://localhost:{port}')"
    assert f"offending line: {offending} (exception in thread nixl_handshake_listener)" in message
    log = Path(re.findall(r"log: (\S+\.log)", message)[0])
    assert log in pd.logs and offending in log.read_text()
    # Within seconds of the line: the last vLLM timestamp before it, plus the poll and a
    # 5 s stop of the wedged servers, against 600 s.
    assert (failed_at - _last_stamp_before(log, "Exception in thread nixl_handshake_listener")).total_seconds() < 20
    assert elapsed < 600
    assert "port collision, starting again" not in caplog.text
    assert not any(_alive(srv.pid) for srv in pd.servers if srv.pid is not None)


def _last_stamp_before(log: Path, marker: str) -> datetime:
    """The time of the last vLLM record (``INFO 12-01 02:27:11``) before the marker line."""
    stamp = None
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith(marker):
            break
        found = re.search(r" (\d\d-\d\d \d\d:\d\d:\d\d) \[", line)
        if found:
            stamp = found[1]
    assert stamp is not None, f"no vLLM timestamp before {marker!r} in {log}"
    return datetime.strptime(f"{datetime.now().year}-{stamp}", "%Y-%m-%d %H:%M:%S")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def servers(pd: PDServers) -> list[VLLMServer]:
    """The session pair's two server processes, when this process started them."""
    if pd.local is None:
        pytest.skip("an attached pair: its processes are not ours to watch")
    return pd.local.servers


def test_an_idle_pair_leaves_the_cores_free(servers: list[VLLMServer]) -> None:
    """NIXL's progress thread spins a whole core by default: LocalPD's servers must not."""
    sessions = {srv.pid for srv in servers}  # each server runs in its own session
    before, started = _cpu_seconds_by_session(sessions), time.monotonic()
    time.sleep(3.0)
    after, elapsed = _cpu_seconds_by_session(sessions), time.monotonic() - started
    busy = {sid: (after[sid] - before[sid]) / elapsed for sid in sessions}
    assert all(share < 0.5 for share in busy.values()), f"idle servers use these shares of a core: {busy}"


def _cpu_seconds_by_session(sessions: set[int | None]) -> dict[int | None, float]:
    """User + system CPU seconds of every process in each session (vLLM's forked engine too)."""
    totals: dict[int | None, float] = dict.fromkeys(sessions, 0.0)
    ticks_per_second = os.sysconf("SC_CLK_TCK")
    for _, _, stat in _proc_stats():
        if int(stat[3]) in totals:
            totals[int(stat[3])] += (int(stat[11]) + int(stat[12])) / ticks_per_second
    return totals


def test_each_server_computes_on_its_own_core(servers: list[VLLMServer]) -> None:
    """vLLM's NIXL worker moves its model thread to the machine's last core unless told not to."""
    for srv in servers:
        _computes_on(srv, int(srv.env["VLLM_CPU_OMP_THREADS_BIND"]))


def _computes_on(srv: VLLMServer, cpu: int | None) -> None:
    """Every thread of the server's vLLM worker process is allowed on ``cpu`` only."""
    core = {cpu}
    workers = [pid for pid, comm in _processes_in_session(srv.pid) if comm.startswith("VLLM::Worker")]
    assert workers, f"no vLLM worker process found for the {srv.name} server"
    strays = {
        (pid, int(tid)): os.sched_getaffinity(int(tid))
        for pid in workers
        for tid in os.listdir(f"/proc/{pid}/task")
        if os.sched_getaffinity(int(tid)) - core
    }
    assert not strays, f"{srv.name} server threads off core {core}: {strays}"


def _processes_in_session(session: int | None) -> list[tuple[int, str]]:
    return [(pid, comm) for pid, comm, stat in _proc_stats() if int(stat[3]) == session]


def _proc_stats() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, name, the /proc/<pid>/stat fields after the name) of every process."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                head, tail = stat.read().rsplit(")", 1)
        except OSError:
            continue  # exited meanwhile
        yield int(entry), head.split("(", 1)[1], tail.split()


def _available_memory_gb() -> float:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) / 2**20


@pytest.mark.timeout(600)  # two starts of three servers on two cores: ~4 min on a Zen 1 EPYC
def test_a_trio_whose_first_start_hits_a_port_collision_starts_again_and_hands_off_to_each_decode(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """LocalPD(decode_servers=2) whose first attempt gives the prefill a side-channel port that
    is taken: the second attempt gets new ports and works. Then three servers, each on its
    core, and a KV handoff to each decode over NIXL.

    One start for both (a start costs a minute or more on a slow CPU). The handoffs are
    written against the wire contract with plain httpx, as LocalPD's warm-up is. Three more
    servers (~3.7 GB each) beside the session pair: skipped when memory is short.
    """
    if _available_memory_gb() < 13:
        pytest.skip(f"needs ~13 GB of available memory for three more servers; {_available_memory_gb():.1f} GB")
    port = free_port()

    class FirstAttemptCollides(LocalPD):
        plans = 0

        def _plan_ports(self) -> list[tuple[int, int | None]]:
            plan = super()._plan_ports()
            self.plans += 1
            if self.plans == 1:
                plan[0] = (plan[0][0], port)
            return plan

    caplog.set_level(logging.WARNING, logger="pdclient.local")
    with socket.create_server(("127.0.0.1", port)), FirstAttemptCollides(decode_servers=2) as pd:
        assert pd.plans == 2
        assert pd.start_stats is not None and pd.start_stats.attempts == 2
        assert pd.start_stats.warmup_seconds is not None  # a KV handoff went through
        assert pd.prefill is not None and pd.prefill.nixl_side_channel_port != port
        _hand_off_to_each_decode(pd)
    assert "port collision, starting again with new ports: prefill server" in caplog.text
    assert f"Address already in use (addr='tcp://localhost:{port}')" in caplog.text
    assert not any(_alive(srv.pid) for srv in pd.servers if srv.pid is not None)


def _hand_off_to_each_decode(pd: LocalPD) -> None:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    assert len(pd.servers) == 3 and pd.decode_urls[0] == pd.decode_url
    assert pd.cpus == assign_cpus(1, 2, sorted(os.sched_getaffinity(0)))
    answers = []
    with httpx.Client(timeout=300) as http:
        for decode_url in pd.decode_urls:
            pulls = metric(decode_url, "vllm:nixl_xfer_time_seconds_count")
            prefill_body = {
                **body,
                "max_tokens": 1,
                "return_token_ids": True,
                "kv_transfer_params": dict(PREFILL_KV_TRANSFER_PARAMS),
            }
            prefill = http.post(f"{pd.prefill_url}/chat/completions", json=prefill_body).raise_for_status().json()
            kv = {**prefill["kv_transfer_params"], "prompt_token_ids": prefill["prompt_token_ids"]}
            decode = http.post(f"{decode_url}/chat/completions", json={**body, "kv_transfer_params": kv})
            answers.append(decode.raise_for_status().json()["choices"][0]["message"]["content"])
            assert metric(decode_url, "vllm:nixl_xfer_time_seconds_count") == pulls + 1, decode_url
        # The prefill server's own answer (asked last: a decode server asked first would
        # have the prompt in its prefix cache and pull nothing).
        reference = http.post(f"{pd.prefill_url}/chat/completions", json=body).raise_for_status().json()
    assert answers == [reference["choices"][0]["message"]["content"]] * 2
    for srv, cpu in zip(pd.servers, pd.cpus, strict=True):
        _computes_on(srv, cpu)


def test_the_servers_compute_with_the_instruction_sets_asked_for(pd: PDServers) -> None:
    """vLLM picks its kernel library from the CPU's features; ``cpu_isa`` (the session pair:
    ``$PDCLIENT_SERVER_CPU_ISA``) makes it pick as a CPU with fewer would."""
    if pd.local is None:
        pytest.skip("an attached pair (PDCLIENT_E2E_PAIR): its servers are not this process's")
    flags = set(re.findall(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M)[0].split())
    own = "_C" if "avx512_bf16" in flags else "_C_AVX512" if "avx512f" in flags else "_C_AVX2"
    expected = {None: own, "avx512": "_C_AVX512", "avx2": "_C_AVX2"}[pd.local.cpu_isa]
    for server in (*pd.local.prefills, *pd.local.decodes):
        maps = Path(f"/proc/{server.pid}/maps").read_text()
        loaded = set(re.findall(r"/vllm/(_C\w*)\.abi3\.so", maps))
        assert loaded == {expected}, (server.name, loaded, pd.local.cpu_isa)
