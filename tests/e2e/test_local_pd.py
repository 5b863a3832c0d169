"""LocalPD's own failure modes: clear errors, nothing left running."""

from __future__ import annotations

import os
import socket
import time

import pytest

from pdclient import PDSetupError
from pdclient.local import LocalPD


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
