"""LocalPD's watch over starting servers, with stand-in processes instead of vLLM.

Each stand-in is a VLLMServer whose command is a sleeping Python; the test writes the
log lines a vLLM server would. What must hold: a fatal line or an exit fails the wait
within a poll or two, whichever server it is, also while the warm-up handoff is stuck.
"""

from __future__ import annotations

import http.server
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdclient import PDSetupError
from pdclient.local import LocalPD
from pdclient.local._server import ServerStartError, VLLMServer, free_port, wait_all_ready
from pdclient.pools import RetrySettings

LISTENER_DIED = (
    "Exception in thread nixl_handshake_listener:\n"
    "Traceback (most recent call last):\n"
    '  File "base_scheduler.py", line 351, in _nixl_handshake_listener\n'
    "zmq.error.ZMQError: Address already in use (addr='tcp://localhost:20001')\n"
)


def stand_in(tmp_path: Path, name: str, script: str = "import time; time.sleep(60)") -> VLLMServer:
    port = free_port()
    srv = VLLMServer(
        name=name,
        python=Path(sys.executable),
        model=tmp_path,
        port=port,
        log_path=tmp_path / f"{name}-{port}.log",
        workdir=tmp_path,
        kv_connector="nixl",
        cpu=None,
        nixl_side_channel_port=20001,
    )
    srv.argv = [sys.executable, "-c", script]
    return srv


@pytest.fixture
def servers(tmp_path: Path) -> Iterator[list[VLLMServer]]:
    started = [stand_in(tmp_path, "prefill"), stand_in(tmp_path, "decode")]
    for srv in started:
        srv.start()
    yield started
    for srv in started:
        srv.stop(grace=1)


def write_later(path: Path, text: str, delay: float = 1.0) -> None:
    def write() -> None:
        time.sleep(delay)
        with open(path, "a") as f:
            f.write(text)

    threading.Thread(target=write, daemon=True).start()


def test_a_fatal_line_in_any_log_ends_the_wait_for_readiness(servers: list[VLLMServer]) -> None:
    decode = servers[1]  # the second server: the wait must not be stuck on the first
    write_later(decode.log_path, "(EngineCore pid=1) INFO 12-01 02:27:11 [x.py:1] loading\n" + LISTENER_DIED)
    started = time.monotonic()
    with pytest.raises(ServerStartError) as info:
        wait_all_ready(servers, time.monotonic() + 600)
    assert time.monotonic() - started < 5
    assert info.value.port_collision
    message = str(info.value)
    assert message.startswith(
        f"decode server logged a fatal error while starting (API port {decode.port}, NIXL side channel 20001); "
        f"log: {decode.log_path}\n  offending line: zmq.error.ZMQError: Address already in use"
    )


def test_an_exit_ends_the_wait_with_the_last_lines(tmp_path: Path) -> None:
    srv = stand_in(
        tmp_path, "prefill", "import sys; print('api_server.py: error: unrecognized arguments: --x'); sys.exit(2)"
    )
    srv.start()
    try:
        with pytest.raises(ServerStartError, match=r"(?s)exited with code 2 while starting.*unrecognized arguments"):
            wait_all_ready([srv], time.monotonic() + 600)
    finally:
        srv.stop(grace=1)


def test_the_timeout_names_the_server_still_loading(servers: list[VLLMServer]) -> None:
    with pytest.raises(
        Exception, match=r"prefill server did not answer /health within the startup timeout \(API port \d+"
    ):
        wait_all_ready(servers, time.monotonic() + 1)


def test_a_fatal_line_ends_a_stuck_warm_up(servers: list[VLLMServer]) -> None:
    """The prefill accepts the handoff's connection and never answers; the decode's log then says why."""
    prefill, decode = servers
    pd = LocalPD()
    pd.prefills, pd.decodes = [prefill], [decode]
    with socket.create_server(("127.0.0.1", prefill.port)):
        write_later(
            decode.log_path, "(EngineCore pid=7) ERROR 12-01 03:00:00 [core.py:1] EngineCore failed to start.\n"
        )
        started = time.monotonic()
        with pytest.raises(
            ServerStartError, match=r"decode server logged a fatal error while warming up \(API port"
        ) as info:
            pd._warm_up()
        assert time.monotonic() - started < 5
    assert not info.value.port_collision
    assert "offending line: (EngineCore pid=7) ERROR 12-01 03:00:00 [core.py:1] EngineCore failed to start." in str(
        info.value
    )


class HandoffStandIns:
    """A prefill that answers and a decode whose first ``hang`` calls never do, on the stand-ins' ports."""

    def __init__(self, prefill: VLLMServer, decode: VLLMServer, hang: int, status: int = 200) -> None:
        self.request_ids: list[str] = []
        self.released = threading.Event()
        stand_ins = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["content-length"]))
                decoding = self.server is stand_ins.servers[1]
                if decoding:
                    stand_ins.request_ids.append(self.headers["x-request-id"])
                    if len(stand_ins.request_ids) <= hang:
                        stand_ins.released.wait(30)
                        return
                body = {"prompt_token_ids": [1, 2], "kv_transfer_params": {"remote_engine_id": "p"}}
                self.send_response(status if decoding else 200)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(json.dumps(body).encode())

            def log_message(self, *args: object) -> None:
                pass

        self.servers = [http.server.ThreadingHTTPServer(("127.0.0.1", srv.port), Handler) for srv in (prefill, decode)]
        for server in self.servers:
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.released.set()
        for server in self.servers:
            server.shutdown()
            server.server_close()


@pytest.fixture
def pair_of_stand_ins(servers: list[VLLMServer], monkeypatch: pytest.MonkeyPatch) -> LocalPD:
    monkeypatch.setattr("pdclient.local._pair._WARM_UP_TRY_S", 1.0)
    pd = LocalPD(startup_timeout=20)
    pd.prefills, pd.decodes = servers[:1], servers[1:]
    return pd


def test_a_warm_up_handoff_that_gets_no_answer_is_sent_again_under_a_new_id(
    servers: list[VLLMServer], pair_of_stand_ins: LocalPD
) -> None:
    """A push-mode decode that registered after the prefill's lease waits for ever; the
    warm-up sends the handoff again rather than wait out its whole timeout."""
    stand_ins = HandoffStandIns(*servers, hang=2)
    try:
        started = time.monotonic()
        pair_of_stand_ins._warm_up()
        assert time.monotonic() - started < 10
    finally:
        stand_ins.close()
    assert len(stand_ins.request_ids) == 3 and len(set(stand_ins.request_ids)) == 3


def test_a_warm_up_handoff_answered_with_an_error_fails_at_once(
    servers: list[VLLMServer], pair_of_stand_ins: LocalPD
) -> None:
    stand_ins = HandoffStandIns(*servers, hang=0, status=500)
    try:
        with pytest.raises(PDSetupError, match=r"the warm-up handoff failed .*500"):
            pair_of_stand_ins._warm_up()
    finally:
        stand_ins.close()
    assert len(stand_ins.request_ids) == 1


@pytest.mark.parametrize(("name", "connector"), [
    ("nixl", "NixlConnector"),
    ("NixlConnector", "NixlConnector"),
    ("nixl-push", "NixlPushConnector"),
    ("NixlPushConnector", "NixlPushConnector"),
])  # fmt: skip
def test_each_kv_connector_name_gives_its_vllm_config(tmp_path: Path, name: str, connector: str) -> None:
    srv = VLLMServer(
        name="decode", python=Path(sys.executable), model=tmp_path, port=free_port(),
        log_path=tmp_path / "decode.log", workdir=tmp_path, kv_connector=name, cpu=None,
    )  # fmt: skip
    config = json.loads(srv.argv[srv.argv.index("--kv-transfer-config") + 1])
    assert config["kv_connector"] == connector and config["kv_role"] == "kv_both"
    assert config["kv_buffer_device"] == "cpu"
    # Only a push-mode engine idles for a whole prefill: it alone waits instead of stepping.
    assert srv.env.get("PDCLIENT_IDLE_WAIT_MS") == ("10" if connector == "NixlPushConnector" else None)
    # Only a push-mode decode holds blocks for a WRITE that may never come; the reclaim
    # deadline (lease + grace) stays above the client's prefill_timeout.
    push = connector == "NixlPushConnector"
    assert srv.env.get("PDCLIENT_PUSH_RECLAIM_GRACE_S") == ("10" if push else None)
    assert srv.env.get("PDCLIENT_PUSH_REFUSE_STALE_WRITE") == ("1" if push else None)
    assert srv.env.get("PDCLIENT_PUSH_FAIL_NOTIFY") == ("1" if push else None)
    if push:
        lease = config["kv_connector_extra_config"]["kv_lease_duration"]
        prefill_timeout = RetrySettings().prefill_timeout
        assert prefill_timeout is not None and lease + 10 > prefill_timeout


def test_an_unknown_kv_connector_names_the_known_ones(tmp_path: Path) -> None:
    with pytest.raises(PDSetupError, match=r"unknown kv_connector 'push'.*'nixl-push'"):
        VLLMServer(
            name="decode", python=Path(sys.executable), model=tmp_path, port=free_port(),
            log_path=tmp_path / "decode.log", workdir=tmp_path, kv_connector="push", cpu=None,
        )  # fmt: skip


ANSWERS_HTTP = """
import http.server, sys
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
"""


def test_restart_starts_one_server_again_on_its_port(tmp_path: Path) -> None:
    """A restart is a new process on the same port, ready when it returns; the other
    server is left running."""
    prefill, decode = stand_in(tmp_path, "prefill"), stand_in(tmp_path, "decode")
    decode.argv = [sys.executable, "-c", ANSWERS_HTTP, str(decode.port)]
    pd = LocalPD(warmup=False, cpus=None)
    pd.prefills, pd.decodes = [prefill], [decode]
    try:
        for srv in pd.servers:
            srv.start()
        decode.wait_ready(time.monotonic() + 30)
        before, prefill_pid = decode.pid, prefill.pid
        assert pd.restart(decode) is decode
        assert decode.pid != before and decode.running and decode.port == int(decode.argv[-1])
        assert prefill.pid == prefill_pid and prefill.running
        with socket.create_connection(("127.0.0.1", decode.port), timeout=5):
            pass  # it answers at once
        with pytest.raises(Exception, match="not one of this pair's servers"):
            pd.restart(stand_in(tmp_path, "stranger"))
    finally:
        pd.stop()
