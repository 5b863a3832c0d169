"""With a third vLLM server that has no KV connector: doctor says no, and killing it mid-run is safe.

The server starts once for this module (~40-80 s) and its two tests run in order: the
second kills it. It shares the decode server's core, not the prefill's: the
doctor's handoff to it leaves KV on the prefill server that nothing pulls, and until that
lease runs out (120 s) the prefill's worker spins at 100 % of its core. A server beside it
answered a 12-token prompt in 122 s there, against 4.5 s beside the idle decode (measured on
a 2-core AMD EPYC, Zen 1). Memory is ~3.7 GB.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import openai
import pytest

from pdclient import PDChatClient, PDTrace
from pdclient.cli.doctor import run_doctor
from pdclient.local import PDServers, _prepare
from pdclient.local._server import VLLMServer, free_port

from .helpers import GREEDY, chat_text, user


@pytest.fixture(scope="module")
def plain_server(pd: PDServers) -> Iterator[VLLMServer]:
    port = free_port()
    server = VLLMServer(
        name="plain",
        python=_prepare.server_python(),
        model=_prepare.model_dir(),
        port=port,
        log_path=_prepare.cache_dir() / "logs" / f"plain-{port}.log",
        workdir=_prepare.cache_dir(),
        kv_connector=None,
        cpu=pd.local.cpus[-1] if pd.local is not None else None,
    )
    server.start()
    try:
        server.wait_ready(time.monotonic() + 600)
        yield server
    finally:
        server.stop()


def test_doctor_says_no_when_decode_has_no_kv_connector(pd: PDServers, plain_server: VLLMServer) -> None:
    # A generous per-request timeout: this server shares a core with the decode's NIXL worker.
    report = run_doctor(pd.prefill_url, plain_server.base_url + "/v1", pd.model, timeout=300)
    table = report.table()
    verdicts = {c.name: c.ok for c in report.checks}
    assert not report.can_reuse_tokens, table
    assert verdicts.get("prefill KV connector") is True, table
    assert verdicts.get("handoff completes") is True, table
    # The plain server still reuses the ids (vLLM's renderer does), but recomputes the KV.
    assert verdicts.get("decode pulled the KV") is False, table
    assert verdicts.get("decode honors forwarded ids") is True, table
    assert "NO token-reusing P/D handoff" in table


def test_prefill_killed_mid_run_falls_back(pd: PDServers, plain: openai.OpenAI, plain_server: VLLMServer) -> None:
    """The prefill server is frozen (SIGSTOP), the calls connect and send, then it is SIGKILLed.

    Freezing first makes "mid-run" certain rather than a race with a fast prefill: the
    kernel still accepts the connections, so every call is in flight when the server dies.
    """
    questions = [f"Name a famous landmark in city number {k} of this list: Paris, Rome, Tokyo." for k in range(3)]
    prefill_url = plain_server.base_url + "/v1"
    assert plain_server.pid is not None
    traces: list[PDTrace] = []
    answers: dict[int, str | BaseException] = {}

    def ask(k: int) -> None:
        client = PDChatClient(
            prefill_base_url=prefill_url,
            decode_base_url=pd.decode_url,
            api_key="EMPTY",
            on_trace=traces.append,
            timeout=120,
            max_retries=0,
        )
        try:
            r = client.chat.completions.create(model=pd.model, messages=user(questions[k]), **GREEDY)
            answers[k] = r.choices[0].message.content or ""
        except openai.APIError as exc:
            answers[k] = exc
        finally:
            client.close()

    os.killpg(plain_server.pid, signal.SIGSTOP)
    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(questions))]
    for t in threads:
        t.start()
    time.sleep(3)  # the requests are sent and waiting on the frozen server
    os.killpg(plain_server.pid, signal.SIGKILL)
    plain_server.stop()
    for t in threads:
        t.join(timeout=240)
    assert not any(t.is_alive() for t in threads), "a call hung after the prefill server died"

    assert len(answers) == len(questions) == len(traces)
    for k, answer in answers.items():
        assert not isinstance(answer, BaseException), f"call {k} failed instead of falling back: {answer}"
        # The three fallbacks ran batched on decode; CPU bf16 greedy is not batch-invariant
        # (see test_concurrency.py), so only the answer's opening is compared.
        assert answer[:10] == chat_text(plain, pd.model, questions[k])[:10], answer
    assert all(t.fallback and t.fallback.startswith("prefill failed") for t in traces), [t.fallback for t in traces]
