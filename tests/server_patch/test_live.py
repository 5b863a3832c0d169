"""Live: a real vLLM 0.32 server (CPU) with the plugin installed, guard and drift check on.

One server per session (about a minute to start here). Skipped on the unpacked old
versions, whose servers cannot run on this machine (FIELD_NOTES.md).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pdclient_server_patch._signing import SIGNATURE_KEY, sign_kv_transfer_params

pytestmark = pytest.mark.live

SECRET = "live-test-secret"
PARAM = "kv_transfer_params.prompt_token_ids"
HELLO = [{"role": "user", "content": "Hello!"}]
OTHER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]


class Server:
    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def post(self, body: dict[str, Any], request_id: str | None = None) -> tuple[int, dict[str, Any]]:
        headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
        request = urllib.request.Request(f"{self.url}/v1/chat/completions", json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, json.load(response)
        except urllib.error.HTTPError as err:
            return err.code, json.load(err)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=30) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0


def _free_port() -> int:
    for port in range(18500, 18600):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 18500-18599")


@pytest.fixture(scope="session")
def server(vllm_version: str, model_dir: str, tmp_path_factory: Any) -> Iterator[Server]:
    if os.environ.get("PDCLIENT_TEST_VLLM_SRC"):
        pytest.skip("live tests run on the installed vLLM 0.32 only")
    workdir = tmp_path_factory.mktemp("vllm-live")  # never server_patch/: it would shadow the plugin
    log = workdir / "server.log"
    port = _free_port()
    env = {
        **{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS")},
        "PDCLIENT_REUSE_SECRET": SECRET,
        "PDCLIENT_REUSE_VERIFY_RATE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "1"),
    }
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir]
    cmd += ["--served-model-name", "smol", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        # ~35-50 s on an idle 2-core machine; much longer when it is shared.
        deadline = time.monotonic() + float(os.environ.get("PDCLIENT_TEST_SERVER_TIMEOUT", "900"))
        while True:
            if proc.poll() is not None:
                pytest.fail(f"vLLM exited with {proc.returncode}; log:\n{log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"vLLM did not become healthy; log:\n{log.read_text()[-4000:]}")
            time.sleep(2)
        yield Server(url, log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def chat(messages: list[dict[str, Any]], kv: Any = None, **extra: Any) -> dict[str, Any]:
    body = {"model": "smol", "messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return {**body, **extra}


def signed(kv: dict[str, Any]) -> dict[str, Any]:
    return {**kv, SIGNATURE_KEY: sign_kv_transfer_params(kv, SECRET)}


@pytest.fixture(scope="session")
def own_ids(server: Server) -> dict[str, list[int]]:
    """The server's own prompt ids for HELLO and OTHER (no kv_transfer_params: unguarded)."""
    ids = {}
    for name, messages in (("hello", HELLO), ("other", OTHER)):
        status, body = server.post(chat(messages))
        assert status == 200, body
        ids[name] = body["prompt_token_ids"]
    return ids


def test_plugin_logged_what_it_applied(server: Server) -> None:
    lines = [line for line in server.log.read_text().splitlines() if "pdclient_reuse 0.1.0 on vLLM 0.32" in line]
    # The API server process is where reuse, guard and drift check act; vLLM prefixes its
    # lines "(MainProcess" or "(APIServer" depending on when logging was configured.
    (api_line,) = [line for line in lines if line.startswith(("(MainProcess", "(APIServer"))]
    assert "reuse: native" in api_line and "guard: on" in api_line and "drift check: on" in api_line


def test_unsigned_and_tampered_are_403(server: Server, own_ids: dict[str, list[int]]) -> None:
    kv = {"do_remote_prefill": True, "prompt_token_ids": own_ids["hello"]}
    status, body = server.post(chat(HELLO, kv))
    assert status == 403, body
    assert body["error"]["param"] == f"kv_transfer_params.{SIGNATURE_KEY}"
    tampered = signed(kv)
    tampered["prompt_token_ids"] = own_ids["other"]
    assert server.post(chat(HELLO, tampered))[0] == 403
    wrong_key = {**kv, SIGNATURE_KEY: sign_kv_transfer_params(kv, "not-the-secret")}
    assert server.post(chat(HELLO, wrong_key))[0] == 403


def test_signed_is_accepted_and_ids_are_reused(server: Server, own_ids: dict[str, list[int]]) -> None:
    checked = server.metric("pdclient_reuse_verify_checked_total")
    mismatched = server.metric("pdclient_reuse_verify_mismatch_total")
    status, body = server.post(chat(HELLO, signed({"do_remote_prefill": False, "prompt_token_ids": own_ids["hello"]})))
    assert status == 200, body
    assert body["prompt_token_ids"] == own_ids["hello"]
    _wait_for(lambda: server.metric("pdclient_reuse_verify_checked_total") >= checked + 1)
    assert server.metric("pdclient_reuse_verify_mismatch_total") == mismatched


def test_drift_check_counts_a_planted_mismatch(server: Server, own_ids: dict[str, list[int]]) -> None:
    mismatched = server.metric("pdclient_reuse_verify_mismatch_total")
    # Signed, so accepted; but the ids are OTHER's while the messages say HELLO.
    kv = signed({"prompt_token_ids": own_ids["other"]})
    status, body = server.post(chat(HELLO, kv), request_id="planted-drift-1")
    assert status == 200, body
    assert body["prompt_token_ids"] == own_ids["other"]  # decode used the forwarded ids
    _wait_for(lambda: server.metric("pdclient_reuse_verify_mismatch_total") >= mismatched + 1)
    _wait_for(lambda: "request planted-drift-1: forwarded prompt_token_ids differ" in server.log.read_text())


@pytest.mark.parametrize("ids", [[], [-1], [1.5], [10**9], [1] * 2049], ids=["empty", "neg", "float", "oov", "long"])
def test_signed_bad_ids_are_400(server: Server, ids: list[Any]) -> None:
    status, body = server.post(chat(HELLO, signed({"prompt_token_ids": ids})))
    assert status == 400, body
    if len(ids) <= 2048:  # vLLM 0.32 names the parameter; too-long fails in get_max_tokens
        assert body["error"]["param"] == PARAM


def _wait_for(condition: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.5)
