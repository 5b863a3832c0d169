"""`pdclient chat` and `pdclient bench` against a respx fake pair (the real pair: tests/pair/test_examples.py)."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdclient.cli import bench, main
from tests.fake_vllm import DECODE, MODEL, PREFILL, FakeVLLM, VLLMAnswers


def quarter_ids(body: dict[str, Any]) -> list[int]:
    return list(range(len(json.dumps(body["messages"])) // 4))  # ~4 characters a token


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeVLLM]:
    monkeypatch.delenv("PDCLIENT_PREFILL_BASE_URL", raising=False)
    monkeypatch.delenv("PDCLIENT_DECODE_BASE_URL", raising=False)
    vllm = FakeVLLM(VLLMAnswers(ids=quarter_ids, text=lambda body: "Paris.", pieces=lambda text: ["Par", "is."]))
    with vllm.routes(PREFILL, DECODE):
        yield vllm


def test_chat_streams_the_answer_and_trace(fake: FakeVLLM, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chat", "--prefill", PREFILL, "--decode", DECODE, "--trace", "Capital", "of", "France?"]) == 0
    out, err = capsys.readouterr()
    assert out == "Paris.\n"
    assert "route=chat" in err and "forwarded_tokens=" in err and "fallback=None" in err
    assert fake.decode_bodies[0]["model"] == MODEL  # the decode server's first model
    assert fake.decode_bodies[0]["messages"] == [{"role": "user", "content": "Capital of France?"}]
    assert fake.decode_bodies[0]["kv_transfer_params"]["prompt_token_ids"]


def test_chat_reads_stdin_and_env(
    fake: FakeVLLM, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("PDCLIENT_PREFILL_BASE_URL", PREFILL)
    monkeypatch.setenv("PDCLIENT_DECODE_BASE_URL", DECODE)
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n"))
    assert main(["chat", "--model", "m", "--system", "Be brief."]) == 0
    assert capsys.readouterr().out == "Paris.\n"
    assert fake.decode_bodies[0]["messages"][0] == {"role": "system", "content": "Be brief."}
    assert fake.decode_bodies[0]["model"] == "m"


def test_chat_errors_are_one_line(fake: FakeVLLM, capsys: pytest.CaptureFixture[str]) -> None:
    fake.router.routes["decode"].mock(
        return_value=httpx.Response(404, json={"error": {"message": "The model `x` does not exist."}})
    )
    assert main(["chat", "--prefill", PREFILL, "--decode", DECODE, "--model", "x", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("pdclient chat: error: HTTP 404")


def test_chat_unreachable_server_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["chat", "--prefill", "http://127.0.0.1:9/v1", "--decode", "http://127.0.0.1:9/v1", "--model", "m", "x"]
    assert main([*argv, "--api-key", "EMPTY"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pdclient chat: error: ") and err.count("\n") == 1


@pytest.mark.parametrize("command", ["chat", "bench", "doctor"])
def test_no_pair_is_one_error_and_starts_nothing(
    command: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """chat, bench and doctor name a pair the same way, and start a local one only with --local."""
    monkeypatch.delenv("PDCLIENT_PREFILL_BASE_URL", raising=False)
    monkeypatch.delenv("PDCLIENT_DECODE_BASE_URL", raising=False)

    def no_local_pair(*args: object, **kwargs: object) -> None:
        raise AssertionError("a LocalPD was started without --local")

    monkeypatch.setattr("pdclient.local.LocalPD.__init__", no_local_pair)
    assert main([command, *(["hi"] if command == "chat" else [])]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"pdclient {command}: error: no pair: give --prefill and --decode") and "--local" in err
    monkeypatch.setenv("PDCLIENT_PREFILL_BASE_URL", PREFILL)
    assert main([command, "--local", *(["hi"] if command == "chat" else [])]) == 1
    assert "--local starts a pair" in capsys.readouterr().err


def test_doctor_reads_the_urls_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    prefill, decode = "http://127.0.0.1:9/v1", "http://127.0.0.2:9/v1"  # nothing listens there
    monkeypatch.setenv("PDCLIENT_PREFILL_BASE_URL", prefill)
    monkeypatch.setenv("PDCLIENT_DECODE_BASE_URL", decode)
    assert main(["doctor", "--timeout", "5"]) == 1
    out = capsys.readouterr().out
    assert f"prefill={prefill}  decode={decode}" in out and "Connection refused" in out


def test_chat_needs_both_urls(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PDCLIENT_DECODE_BASE_URL", raising=False)
    assert main(["chat", "--prefill", PREFILL, "hi"]) == 1
    assert "give both --prefill and --decode" in capsys.readouterr().err


def test_bench_table_json_and_plot(fake: FakeVLLM, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot, raw = tmp_path / "bench.png", tmp_path / "bench.json"
    argv = ["bench", "--prefill", PREFILL, "--decode", DECODE, "--sizes", "64,256", "--pairs", "3"]
    assert main([*argv, "--plot", str(plot), "--json", str(raw)]) == 0
    out = capsys.readouterr().out
    assert "decode TTFT ms: ids" in out and "saving ms [95% CI]" in out
    samples = json.loads(raw.read_text())
    assert len(samples) == 2 * 2 * 3
    # The arms alternate and differ only by the forwarded ids.
    assert [s["arm"] for s in samples[:4]] == ["ids", "no ids", "no ids", "ids"]
    measured = fake.decode_bodies[2:8]  # after the two warm-up calls of the first size
    with_ids = [b for b in measured if "prompt_token_ids" in b["kv_transfer_params"]]
    assert len(with_ids) == 3
    # Every call had its own prompt.
    prompts = [b["messages"][0]["content"] for b in fake.decode_bodies]
    assert len(set(prompts)) == len(prompts)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "plot skipped" in out
    else:
        assert plot.read_bytes()[:4] == b"\x89PNG"


def test_bench_bad_sizes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--prefill", PREFILL, "--decode", DECODE, "--sizes", "1k"]) == 1
    assert capsys.readouterr().err == "pdclient bench: error: --sizes must be comma-separated integers, got '1k'\n"


def test_bootstrap_interval_brackets_the_median() -> None:
    diffs = [10.0 + (i % 7) for i in range(40)]
    low, high = bench.bootstrap_ci(diffs)
    assert low <= sorted(diffs)[20] <= high


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_doctor_refuses_a_timeout_that_is_no_duration(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["doctor", "--prefill", "http://127.0.0.1:9/v1", "--decode", "http://127.0.0.2:9/v1", "--timeout", value])
    assert exited.value.code == 2
    assert "--timeout must be a finite number of seconds > 0" in capsys.readouterr().err
