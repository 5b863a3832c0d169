"""`pdclient doctor` on the real pair (exit 0) and on a pair that cannot do P/D (exit 1).

The pair with a decode server that has no KV connector is in test_plain_server.py.
"""

from __future__ import annotations

import os
import subprocess
import sys

from pdclient._doctor import run_doctor

from pdclient.local import PDServers
from pdclient.local._server import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def doctor_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run(
        [sys.executable, "-m", "pdclient", "doctor", *args], capture_output=True, text=True, env=env, timeout=240
    )


def test_doctor_passes_on_the_local_pair(pd: PDServers) -> None:
    run = doctor_cli("--prefill", pd.prefill_url, "--decode", pd.decode_url, "--model", pd.model)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "FAIL" not in run.stdout
    for check in (
        "prefill returns prompt ids",
        "prefill KV connector",
        "decode pulled the KV",
        "decode honors forwarded ids",
    ):
        assert check in run.stdout
    assert "NixlConnector" in run.stdout
    assert "can do a token-reusing P/D handoff" in run.stdout


def test_doctor_fails_on_a_dead_prefill(pd: PDServers) -> None:
    report = run_doctor(f"http://127.0.0.1:{free_port()}/v1", pd.decode_url, timeout=10)
    assert not report.can_reuse_tokens
    assert [c.name for c in report.checks if c.ok is False] == ["prefill endpoint"]


def test_doctor_fails_on_an_unknown_model(pd: PDServers) -> None:
    run = doctor_cli("--prefill", pd.prefill_url, "--decode", pd.decode_url, "--model", "no-such-model")
    assert run.returncode == 1
    assert "same model" in run.stdout and "FAIL" in run.stdout
