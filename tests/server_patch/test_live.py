"""Live: a real vLLM 0.32 server (CPU) with the plugin installed, guard and drift check on.

The server runs with ``--enable-scale-out`` (for ``/inference/v1/generate``); requests are
signed by pdclient's own signer (``pdclient/wire/_signing.py``, loaded from its file).

One server per session (about a minute to start here). Skipped on the unpacked old
versions, whose servers cannot run on this machine (their CPU torch builds do not install).
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
from pdclient_server_patch._signing import SIGNATURE_HEADER
from test_signing import client_signing

pytestmark = pytest.mark.live

SECRET = "live-test-secret"
PARAM = "kv_transfer_params.prompt_token_ids"
CHAT = "/v1/chat/completions"
GENERATE = "/inference/v1/generate"
HELLO = [{"role": "user", "content": "Hello!"}]
OTHER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
ATTACK = {"do_remote_prefill": True, "remote_host": "203.0.113.7", "remote_port": 1, "remote_block_ids": [1]}


class Server:
    def __init__(self, url: str, log: Path) -> None:
        self.url, self.log = url, log

    def post(
        self, body: dict[str, Any] | bytes, request_id: str | None = None, *, path: str = CHAT, signed: bool = False
    ) -> tuple[int, dict[str, Any]]:
        """POST ``body`` (bytes as they are, a dict as UTF-8 JSON); ``signed``: by pdclient's own signer."""
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"X-Request-Id": request_id} if request_id else {})}
        if signed:
            headers[SIGNATURE_HEADER] = sign(content, path)
        return self.send(path, content, headers)

    def send(self, path: str, content: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
        request = urllib.request.Request(f"{self.url}{path}", content, {"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, _json(response.read())
        except urllib.error.HTTPError as err:
            return err.code, _json(err.read())

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
    cmd += ["--max-model-len", "2048", "--dtype", "bfloat16", "--enforce-eager", "--enable-scale-out"]
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


def _json(raw: bytes) -> dict[str, Any]:
    try:
        parsed = json.loads(raw)
    except ValueError:
        return {"raw": raw.decode("utf-8", "replace")[:500]}
    return parsed if isinstance(parsed, dict) else {"raw": parsed}


def sign(content: bytes, path: str = CHAT, **kwargs: Any) -> str:
    return str(client_signing().signature(SECRET, "POST", path, content, **kwargs))


def chat(messages: list[dict[str, Any]], kv: Any = None, **extra: Any) -> dict[str, Any]:
    body = {"model": "smol", "messages": messages, "max_tokens": 4, "temperature": 0, "return_token_ids": True}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return {**body, **extra}


def refused(status: int, body: dict[str, Any], why: str = "") -> bool:
    return status == 403 and body["error"]["param"] == "kv_transfer_params" and why in body["error"]["message"]


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
    lines = [line for line in server.log.read_text().splitlines() if "pdclient_reuse 0.2.0 on vLLM 0.32" in line]
    # The API server process is where reuse, guard and drift check act; vLLM prefixes its
    # lines "(MainProcess" or "(APIServer" depending on when logging was configured.
    (api_line,) = [line for line in lines if line.startswith(("(MainProcess", "(APIServer"))]
    assert "reuse: native" in api_line and "guard: on" in api_line and "drift check: on" in api_line


@pytest.mark.parametrize("encoding", ["utf-8", "utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"])
def test_unsigned_is_403_in_every_json_encoding(server: Server, encoding: str) -> None:
    # Issue 13 item 1. The control: vLLM's route does read such a body (200 without the key).
    assert server.post(json.dumps(chat(HELLO)).encode(encoding))[0] == 200
    status, body = server.post(json.dumps(chat(HELLO, ATTACK)).encode(encoding))
    assert refused(status, body, "no x-pdclient-signature header"), body


def test_generate_extra_args_need_a_signature(server: Server) -> None:
    # Issue 13 item 2, on the route --enable-scale-out adds.
    plain = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "temperature": 0}}
    assert server.post(plain, path=GENERATE)[0] == 200  # the route is there and reads the body
    attack = {**plain, "sampling_params": {**plain["sampling_params"], "extra_args": {"kv_transfer_params": ATTACK}}}
    status, body = server.post(attack, path=GENERATE)
    assert refused(status, body), body
    harmless = {**plain, "sampling_params": {**plain["sampling_params"], "extra_args": {"kv_transfer_params": {}}}}
    status, body = server.post(harmless, path=GENERATE, signed=True)
    assert status == 200, body


def test_tampered_and_wrong_key_are_403(server: Server, own_ids: dict[str, list[int]]) -> None:
    content = json.dumps(chat(HELLO, {"prompt_token_ids": own_ids["hello"]})).encode()
    header = sign(content)
    tampered = json.dumps(chat(HELLO, {"prompt_token_ids": own_ids["other"]})).encode()
    assert refused(*server.send(CHAT, tampered, {SIGNATURE_HEADER: header}), "does not match")
    wrong_key = client_signing().signature("not-the-secret", "POST", CHAT, content)
    assert refused(*server.send(CHAT, content, {SIGNATURE_HEADER: wrong_key}), "does not match")


def test_replayed_signature_is_403(server: Server, own_ids: dict[str, list[int]]) -> None:
    # Issue 13 item 3: a captured request, sent again as it was.
    content = json.dumps(chat(HELLO, {"prompt_token_ids": own_ids["hello"]})).encode()
    header = {SIGNATURE_HEADER: sign(content)}
    status, body = server.send(CHAT, content, header)
    assert status == 200, body
    assert refused(*server.send(CHAT, content, header), "nonce already used")


@pytest.mark.parametrize(
    "other", [{"messages": OTHER}, {"max_tokens": 16}, {"model": "other"}], ids=["messages", "max_tokens", "model"]
)
def test_captured_signature_with_another_request_is_403(
    server: Server, own_ids: dict[str, list[int]], other: dict[str, Any]
) -> None:
    # Issue 13 item 3: the decode leg's signed params, reused with other messages, model or max_tokens.
    kv = {"prompt_token_ids": own_ids["hello"]}
    header = {SIGNATURE_HEADER: sign(json.dumps(chat(HELLO, kv)).encode())}
    assert refused(*server.send(CHAT, json.dumps({**chat(HELLO, kv), **other}).encode(), header), "does not match")


def test_expired_signature_is_403(server: Server, own_ids: dict[str, list[int]]) -> None:
    content = json.dumps(chat(HELLO, {"prompt_token_ids": own_ids["hello"]})).encode()
    header = {SIGNATURE_HEADER: sign(content, ttl=60, now=time.time() - 61)}
    assert refused(*server.send(CHAT, content, header), "expired")


def test_lone_surrogate_is_never_a_500(server: Server, own_ids: dict[str, list[int]]) -> None:
    # Issue 13 item 4: v1's guard answered 500 to a signed body holding "\ud800".
    body = chat([{"role": "user", "content": "Hello \ud800!"}], {"prompt_token_ids": own_ids["hello"]})
    content = json.dumps(body).encode()
    assert b"\\ud800" in content
    status, answer = server.post(content, signed=True)
    assert status < 500, answer
    assert refused(*server.post(content))  # unsigned, the same body: refused, not a 500


def test_signed_is_accepted_and_ids_are_reused(server: Server, own_ids: dict[str, list[int]]) -> None:
    checked = server.metric("pdclient_reuse_verify_checked_total")
    mismatched = server.metric("pdclient_reuse_verify_mismatch_total")
    kv = {"do_remote_prefill": False, "prompt_token_ids": own_ids["hello"]}
    status, body = server.post(chat(HELLO, kv), signed=True)
    assert status == 200, body
    assert body["prompt_token_ids"] == own_ids["hello"]
    _wait_for(lambda: server.metric("pdclient_reuse_verify_checked_total") >= checked + 1)
    assert server.metric("pdclient_reuse_verify_mismatch_total") == mismatched


def test_drift_check_counts_a_planted_mismatch(server: Server, own_ids: dict[str, list[int]]) -> None:
    mismatched = server.metric("pdclient_reuse_verify_mismatch_total")
    # Signed, so accepted; but the ids are OTHER's while the messages say HELLO.
    kv = {"prompt_token_ids": own_ids["other"]}
    status, body = server.post(chat(HELLO, kv), request_id="planted-drift-1", signed=True)
    assert status == 200, body
    assert body["prompt_token_ids"] == own_ids["other"]  # decode used the forwarded ids
    _wait_for(lambda: server.metric("pdclient_reuse_verify_mismatch_total") >= mismatched + 1)
    _wait_for(lambda: "request planted-drift-1: forwarded prompt_token_ids differ" in server.log.read_text())


@pytest.mark.parametrize("ids", [[], [-1], [1.5], [10**9], [1] * 2049], ids=["empty", "neg", "float", "oov", "long"])
def test_signed_bad_ids_are_400(server: Server, ids: list[Any]) -> None:
    status, body = server.post(chat(HELLO, {"prompt_token_ids": ids}), signed=True)
    assert status == 400, body
    if len(ids) <= 2048:  # vLLM 0.32 names the parameter; too-long fails in get_max_tokens
        assert body["error"]["param"] == PARAM


def _wait_for(condition: Any, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.5)


RESPONSES = "/v1/responses"
MESSAGES = "/v1/messages"


def route_body(path: str, kv: Any = None) -> dict[str, Any]:
    """HELLO as a Responses or a Messages request (greedy, a few tokens)."""
    if path == RESPONSES:
        body: dict[str, Any] = {"model": "smol", "input": HELLO, "max_output_tokens": 4, "temperature": 0}
        body["store"] = False
    else:
        body = {"model": "smol", "messages": HELLO, "max_tokens": 4, "temperature": 0}
    return body if kv is None else {**body, "kv_transfer_params": kv}


def input_tokens(body: dict[str, Any]) -> int:
    return int(body["usage"]["input_tokens"])


@pytest.mark.parametrize("path", [RESPONSES, MESSAGES])
def test_responses_and_messages_guarded_and_ids_reused(
    server: Server, own_ids: dict[str, list[int]], path: str
) -> None:
    status, plain = server.post(route_body(path), path=path)
    assert status == 200, plain
    assert input_tokens(plain) == len(own_ids["hello"])  # the route renders HELLO as chat does
    forwarded = route_body(path, {"prompt_token_ids": own_ids["other"]})
    assert refused(*server.post(forwarded, path=path), "no x-pdclient-signature header")
    status, body = server.post(forwarded, path=path, signed=True)
    assert status == 200, body
    assert input_tokens(body) == len(own_ids["other"])  # the engine ran the forwarded ids
    status, body = server.post(route_body(path, {"prompt_token_ids": [-1]}), path=path, signed=True)
    assert status == 400, body


@pytest.mark.parametrize("path", [RESPONSES, MESSAGES])
def test_return_prompt_token_ids_on_a_server_without_a_kv_connector(server: Server, path: str) -> None:
    # A plain server (no NIXL): the flag is accepted and nothing comes back, as for any kv_transfer_params.
    kv = {"do_remote_decode": True, "do_remote_prefill": False, "return_prompt_token_ids": True}
    status, body = server.post(route_body(path, kv), path=path, signed=True)
    assert status == 200, body
    assert not body.get("kv_transfer_params"), body
