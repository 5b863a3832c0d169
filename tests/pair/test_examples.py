"""The examples, run as a user runs them, against the real local pair (marked e2e).

Each script runs in a subprocess with ``PDCLIENT_PREFILL_BASE_URL`` / ``PDCLIENT_DECODE_BASE_URL``
pointing at the session's pair (so none starts a pair of its own), and the notebook is
executed headlessly with nbclient the same way. Framework examples are skipped when their
package is not installed (requirements-frameworks.txt has them all).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from pdclient.local import PDServers
from tests.pair._pair import Pair

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

# script -> (packages it needs, text its output must contain)
SCRIPTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "demo.py": ((), ("answer=", "outcome=disaggregated", "fallback=None")),
    "chat_stream.py": ((), ("ids forwarded, fallback=None",)),
    "chat_async.py": ((), ("3 handoffs, ids forwarded on 3",)),
    "raw_response_trace.py": ((), ("x-pd-forwarded-tokens", "answer:")),
    "openai_client_transport.py": ((), ("sync: ", "async:", "models via decode:")),
    "langchain_chat.py": (("langchain_openai",), ("invoke:", "stream:", "astream:")),
    "openai_agents.py": (("agents",), ("agent:", "model call(s), each a P/D handoff")),
    "litellm_chat.py": (("litellm",), ("completion:", "async stream:")),
    "otel_spans.py": (("opentelemetry.sdk",), ("pdclient.prefill", "pdclient.decode", "pdclient.forwarded_tokens")),
}


@pytest.fixture(scope="module")
def pair(pd: PDServers) -> Pair:
    return Pair.of(pd)


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def test_every_example_is_tested() -> None:
    scripts = {p.name for p in EXAMPLES.glob("*.py") if not p.name.startswith("_")}
    assert scripts == set(SCRIPTS)  # demo.py is `make demo`, here on the session's pair


@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_example_script(pair: Pair, script: str) -> None:
    needs, expected = SCRIPTS[script]
    for module in needs:
        if not installed(module):
            pytest.skip(f"{module} is not installed (pip install -r requirements-frameworks.txt)")
    if script == "openai_agents.py" and not pair.supports_tools:
        pytest.skip("the shared pair runs without --tool-call-parser, which vLLM needs to accept tools")
    env = {**os.environ, **pair.env()}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script)], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert result.returncode == 0, f"{script} failed:\n{result.stdout}\n{result.stderr}"
    for text in expected:
        assert text in result.stdout, f"{script} printed:\n{result.stdout}\n{result.stderr}"
    assert "Traceback" not in result.stderr


@pytest.mark.timeout(1800, func_only=True)  # 6 calls with ~500-token prompts on 2 shared cores
def test_notebook(pair: Pair, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for module in ("nbclient", "nbformat", "ipykernel", "matplotlib"):
        if not installed(module):
            pytest.skip(f"{module} is not installed (pip install -r requirements-frameworks.txt)")
    import nbformat
    from nbclient import NotebookClient

    for name, value in pair.env().items():
        monkeypatch.setenv(name, value)  # the kernel inherits them: it uses this pair
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend returns the plot as a PNG
    notebook = nbformat.read(EXAMPLES / "pd_quickstart.ipynb", as_version=4)
    NotebookClient(
        notebook, timeout=1200, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    assert "forwarded_tokens" in text and "fallback               None" in text
    assert "decode first byte median" in text
    assert any("image/png" in o.get("data", {}) for o in outputs), "the timing plot was not drawn"
    assert not [o for o in outputs if o.get("output_type") == "error"]


def run_cli(pair: Pair, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **pair.env()}
    return subprocess.run(
        [sys.executable, "-m", "pdclient", *argv], capture_output=True, text=True, env=env, timeout=600, check=False
    )


def test_cli_chat(pair: Pair) -> None:
    question = "What is the capital of France?"
    result = run_cli(pair, "chat", "--trace", "--max-tokens", "16", question)
    assert result.returncode == 0, result.stderr
    # The decode server's own greedy answer, whatever it is on this CPU.
    with openai.OpenAI(base_url=pair.decode_url, api_key="EMPTY") as plain:
        expected = plain.chat.completions.create(
            model=pair.model, messages=[{"role": "user", "content": question}], max_tokens=16, temperature=0
        )
    assert result.stdout == (expected.choices[0].message.content or "") + "\n"
    assert "route=chat" in result.stderr and "fallback=None" in result.stderr
    assert "forwarded_tokens=0" not in result.stderr


def test_cli_bench(pair: Pair, tmp_path: Path) -> None:
    plot = tmp_path / "bench.png"
    result = run_cli(pair, "bench", "--sizes", "200", "--pairs", "3", "--max-tokens", "2", "--plot", str(plot))
    assert result.returncode == 0, result.stderr
    assert "decode TTFT ms: ids" in result.stdout and "saving ms [95% CI]" in result.stdout
    if installed("matplotlib"):
        assert plot.read_bytes()[:4] == b"\x89PNG"


def test_cli_errors_are_one_line(pair: Pair) -> None:
    result = run_cli(pair, "chat", "--prefill", pair.prefill_url, "--decode", pair.decode_url, "--model", "nope", "hi")
    assert result.returncode == 1
    assert result.stderr.startswith("pdclient chat: error: HTTP 404") and result.stderr.count("\n") == 1
