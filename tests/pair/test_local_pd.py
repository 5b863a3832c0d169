"""LocalPD's own failure modes: clear errors, nothing left running."""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest

from pdclient import PDSetupError
from pdclient.local import LocalPD
from pdclient.local._server import VLLMServer


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture
def servers(pd: LocalPD) -> list[VLLMServer]:
    """The session pair's two server processes, when this process started them."""
    started = [srv for srv in (pd.prefill, pd.decode) if srv is not None and srv.pid is not None]
    if len(started) != 2:
        pytest.skip("an attached pair: its processes are not ours to watch")
    return started


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
        core = {int(srv.env["VLLM_CPU_OMP_THREADS_BIND"])}
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
