"""LocalPD's reading of vLLM server logs for fatal lines, on excerpts of real logs (vLLM 0.32 on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdclient.local._logscan import LogScanner

SITE = "/cache/server-env/lib/python3.11/site-packages"

# What a healthy start writes, including the lines that only look alarming.
HEALTHY = f"""\
$ /cache/server-env/bin/python -m vllm.entrypoints.openai.api_server --model /cache/models/SmolLM2 --port 16437
Triton is installed, but doesn't include CPU backend. Disabling Triton.
{SITE}/vllm/entrypoints/openai/api_server.py:24: DeprecationWarning: `vllm.entrypoints.openai.api_server` is deprecated
  warnings.warn(
(APIServer pid=6661) WARNING 12-01 02:08:56 [system_utils.py:255] Found ulimit of 20000 and failed to automatically \
increase with error current limit exceeds maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too \
many open files`. Consider increasing with ulimit -n
(EngineCore pid=6853) INFO 12-01 02:10:14 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config: ...
(Worker pid=7807) WARNING 12-01 02:11:04 [utils.py:597] Failed to create oneDNN linear, fallback to torch linear. \
Exception: could not create a primitive descriptor for the matmul primitive. Run workload with environment variable \
ONEDNN_VERBOSE=all for more information.
(EngineCore pid=6853) WARNING 12-01 02:11:08 [parallel.py:746] Address already in use. Retrying with a new port.
(EngineCore pid=6853) INFO 12-01 02:11:08 [network_utils.py:248] Port 29500 is already in use, trying port 29501
Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:02<00:00,  2.63s/it]\r
(EngineCore pid=6853) INFO 12-01 02:11:13 [core.py:402] init engine (profile, create kv cache, warmup model) took 6.94 s
(APIServer pid=6661) INFO 12-01 02:11:20 [entry.py:140] Starting vLLM server on http://127.0.0.1:34649
INFO:     Started server process [6661]
INFO:     Application startup complete.
INFO:     127.0.0.1:60130 - "GET /health HTTP/1.1" 200 OK
INFO:     127.0.0.1:60146 - "POST /v1/chat/completions HTTP/1.1" 200 OK
"""

# The NIXL handshake listener thread could not bind its side-channel port (issue 13):
# printed by threading's excepthook, without vLLM's process prefix.
LISTENER_DIED = f"""\
(EngineCore pid=15205) INFO 12-01 02:27:11 [base_scheduler.py:109] Initializing NIXL Scheduler 5f7539bf
Exception in thread nixl_handshake_listener:
Traceback (most recent call last):
  File "/usr/lib/python3.11/threading.py", line 1045, in _bootstrap_inner
    self.run()
  File "{SITE}/vllm/distributed/kv_transfer/.../nixl/base_scheduler.py", line 351, in _nixl_handshake_listener
    with zmq_ctx(zmq.ROUTER, path) as sock:
  File "{SITE}/vllm/utils/network_utils.py", line 402, in make_zmq_socket
    socket.bind(path)
  File "zmq/backend/cython/_zmq.py", line 190, in zmq.backend.cython._zmq._check_rc
zmq.error.ZMQError: Address already in use (addr='tcp://localhost:24897')
(EngineCore pid=15205) INFO 12-01 02:27:25 [core.py:1454] [shutdown] EngineCore: trigger received signal=SIGTERM
"""

# logger.exception in the engine core: vLLM repeats the record prefix on every line.
ENGINE_FAILED = f"""\
(EngineCore pid=17127) ERROR 12-01 02:30:37 [core.py:1510] Traceback (most recent call last):
(EngineCore pid=17127) ERROR 12-01 02:30:37 [core.py:1510]   File "{SITE}/vllm/v1/engine/core.py", line 1482, in run
(EngineCore pid=17127) ERROR 12-01 02:30:37 [core.py:1510]     engine_core = EngineCoreProc(*args, **kwargs)
(EngineCore pid=17127) ERROR 12-01 02:30:37 [core.py:1510]                   ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
(EngineCore pid=17127) ERROR 12-01 02:30:37 [core.py:1510] RuntimeError: cannot allocate the KV cache
"""

API_PORT_TAKEN = f"""\
(APIServer pid=9001) INFO 12-01 03:00:00 [api_utils.py:286] non-default args: {{'port': 16437}}
Traceback (most recent call last):
  File "{SITE}/vllm/entrypoints/openai/api_server.py", line 60, in <module>
    uvloop.run(run_server(args))
  File "{SITE}/vllm/entrypoints/openai/api_server.py", line 40, in create_server_socket
    sock.bind(addr)
OSError: [Errno 98] Address already in use
"""


def scan(text: str) -> str | None:
    scanner = LogScanner(Path("/nonexistent"))
    fatal = scanner.feed(text)
    return None if fatal is None else f"{fatal.line} | {fatal.context} | collision={fatal.port_collision}"


def test_a_healthy_start_has_no_fatal_line() -> None:
    assert scan(HEALTHY) is None


def test_a_dead_handshake_listener_is_a_port_collision_named_by_its_thread() -> None:
    assert scan(HEALTHY + LISTENER_DIED) == (
        "zmq.error.ZMQError: Address already in use (addr='tcp://localhost:24897') "
        "| exception in thread nixl_handshake_listener | collision=True"
    )


def test_a_zmq_collision_names_its_port() -> None:
    fatal = LogScanner(Path("/nonexistent")).feed(HEALTHY + LISTENER_DIED)
    assert fatal is not None and fatal.ports == {24897}
    api = LogScanner(Path("/nonexistent")).feed(API_PORT_TAKEN)
    assert api is not None and api.ports == frozenset()  # uvicorn's line names none


def test_a_traceback_logged_by_vllm_names_its_process() -> None:
    assert scan(HEALTHY + ENGINE_FAILED) == (
        "(EngineCore pid=17127) ERROR 12-01 02:30:37 [core.py:1510] RuntimeError: cannot allocate the KV cache "
        "| traceback, EngineCore process | collision=False"
    )


def test_an_api_port_taken_is_a_collision() -> None:
    assert scan(API_PORT_TAKEN) == "OSError: [Errno 98] Address already in use | traceback | collision=True"


@pytest.mark.parametrize(
    "line",
    [
        "(EngineCore pid=17127) ERROR 12-01 02:30:37 [core.py:1510] EngineCore failed to start.",
        "(APIServer pid=6661) ERROR 12-01 02:34:31 [async_llm.py:906] vllm.v1.engine.exceptions.EngineDeadError: dead",
        "(EngineCore pid=15205) ERROR 12-01 02:27:37 [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
        "unexpectedly (exit code: None), shutting down executor.",
        "Fatal Python error: Segmentation fault",
    ],
)
def test_vllms_own_verdicts_are_fatal(line: str) -> None:
    assert scan(line + "\n") == f"{line} |  | collision=False"


def test_an_error_record_about_a_taken_port_is_a_collision_but_a_warning_is_not() -> None:
    error = (
        "ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', 16437): address already in use"
    )
    assert scan(error + "\n") == f"{error} |  | collision=True"
    assert (
        scan("(EngineCore pid=1) WARNING 12-01 02:11:08 [parallel.py:746] Address already in use. Retrying.\n") is None
    )


def test_an_ignored_exception_is_not_fatal() -> None:
    text = (
        "Exception ignored in: <function Socket.__del__ at 0x7f>\n"
        "Traceback (most recent call last):\n"
        '  File "zmq/sugar/socket.py", line 180, in __del__\n'
        "ResourceWarning: unclosed socket\n"
    )
    assert scan(text) is None
    assert scan(text + ENGINE_FAILED) is not None  # and the next traceback still counts


def test_tracebacks_of_processes_writing_at_once_are_kept_apart() -> None:
    text = (
        "(EngineCore pid=1) ERROR 12-01 02:30:37 [core.py:1] Traceback (most recent call last):\n"
        "(APIServer pid=2) INFO 12-01 02:30:37 [entry.py:1] Still loading\n"
        '(EngineCore pid=1) ERROR 12-01 02:30:37 [core.py:1]   File "core.py", line 1, in run\n'
        "(EngineCore pid=1) ERROR 12-01 02:30:37 [core.py:1] ValueError: bad\n"
    )
    assert scan(text) == (
        "(EngineCore pid=1) ERROR 12-01 02:30:37 [core.py:1] ValueError: bad | traceback, EngineCore process "
        "| collision=False"
    )


def test_lines_split_across_reads_and_the_file_read_incrementally(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text(HEALTHY)
    scanner = LogScanner(log)
    assert scanner.scan() is None
    head, tail = LISTENER_DIED[:-120], LISTENER_DIED[-120:]
    with open(log, "a") as f:
        f.write(head)
    assert scanner.scan() is None
    with open(log, "a") as f:
        f.write(tail)
    fatal = scanner.scan()
    assert fatal is not None and fatal.port_collision
    assert scanner.scan() is fatal  # sticky: the first fatal line stays the answer
