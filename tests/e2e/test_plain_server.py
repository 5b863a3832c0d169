"""With a third vLLM server that has no KV connector: doctor says no, and killing it mid-run is safe.

The server starts once for this module (~40-80 s) and its two tests run in order: the
second kills it. It shares core 0 with the prefill server; memory is ~3.7 GB.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import openai
import pytest

from pdclient import PDChatClient, PDTrace
from pdclient._doctor import run_doctor
from pdclient.local import LocalPD, _prepare
from pdclient.local._server import VLLMServer, free_port

from .helpers import GREEDY, chat_text, metric, user


@pytest.fixture(scope="module")
def plain_server(pd: LocalPD) -> Iterator[VLLMServer]:
    port = free_port()
    server = VLLMServer(
        name="plain",
        python=_prepare.server_python(),
        model=_prepare.model_dir(),
        port=port,
        log_path=_prepare.cache_dir() / "logs" / f"plain-{port}.log",
        workdir=_prepare.cache_dir(),
        kv_connector=None,
        cpu=0,
    )
    server.start()
    try:
        server.wait_ready(time.monotonic() + 600)
        yield server
    finally:
        server.stop()


def test_doctor_says_no_when_decode_has_no_kv_connector(pd: LocalPD, plain_server: VLLMServer) -> None:
    report = run_doctor(pd.prefill_url, plain_server.base_url + "/v1", pd.model)
    verdicts = {c.name: c.ok for c in report.checks}
    assert not report.can_reuse_tokens, report.table()
    assert verdicts["prefill KV connector"] is True
    # The plain server still reuses the ids (vLLM's renderer does), but recomputes the KV.
    assert verdicts["decode pulled the KV"] is False, report.table()
    assert verdicts["decode honors forwarded ids"] is True, report.table()
    assert "NO token-reusing P/D handoff" in report.table()


def test_prefill_killed_mid_run_falls_back(pd: LocalPD, plain: openai.OpenAI, plain_server: VLLMServer) -> None:
    """Long prompts keep the prefill busy; it is SIGKILLed once it holds requests."""
    filler = " ".join(f"Note {i}: the archive lists item {i * 7} on shelf {i % 13}." for i in range(90))
    questions = [f"{filler}\nQuestion {k}: which shelf holds item {k * 7}?" for k in range(4)]
    prefill_url = plain_server.base_url + "/v1"
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

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(len(questions))]
    started = time.monotonic()
    for t in threads:
        t.start()
    while metric(prefill_url, "vllm:num_requests_running") + metric(prefill_url, "vllm:num_requests_waiting") < 1:
        assert time.monotonic() - started < 60, "the prefill server never saw the requests"
        time.sleep(0.05)
    plain_server.stop()  # SIGTERM then SIGKILL to its process group, while it holds requests
    for t in threads:
        t.join(timeout=180)
    assert not any(t.is_alive() for t in threads), "a call hung after the prefill server died"

    assert len(answers) == len(questions)
    failed_prefill = [t for t in traces if t.fallback and t.fallback.startswith("prefill failed")]
    assert failed_prefill, f"no call saw the prefill die: {[t.fallback for t in traces]}"
    for k, answer in answers.items():
        assert not isinstance(answer, BaseException), f"call {k} failed instead of falling back: {answer}"
        assert answer == chat_text(plain, pd.model, questions[k])
