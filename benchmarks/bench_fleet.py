"""Fleet routing (issue 12): load signals across client processes, cache-aware prefill routing.

(a) Load: four client processes share three stub decode servers (tests/stubserver.py, each
    in a process of its own) of 8 slots each; a decode step (one streamed event) takes
    10 ms + 4 ms per running request, and KV usage is running / 8. One server is slow, in
    one of two ways: ``tenant``, another tenant's long requests hold 6 of its slots (and
    lengthen its steps), which no client process can see from its own calls; ``hardware``,
    every step takes 4x as long, and only these clients use it. Each process keeps
    ``--concurrency`` streamed calls going and lists the servers in its own order (as DNS
    or per-host configs hand them out, so least-outstanding's first-listed tie-break is no
    fixed preference). Arms: ``least_outstanding`` (each process's own in-flight counts)
    and ``load_aware`` (the servers' /metrics scraped by each process with the default
    ScrapeSettings: every 0.5 s, fresh for 2 s; default LoadAware). Rounds interleave.

(b) Prefix cache: one client process, three stub prefill servers that model a prefix
    cache (LRU, ``--cache-chars`` per server, 5 us per uncached character, one prefill at
    a time). Two workloads: ``conversations`` (48 chats of 4 turns, no shared prefix beyond
    a one-line system message) and ``shared`` (64 users, 3 turns each, each chat opening
    with one of 4 system prompts of 8000 characters), 8 chats in flight. Arms:
    ``round_robin``, ``affinity`` (rendezvous on the conversation's opening) and
    ``cache_aware``. Hit rate is the stubs' own count (cached / queried characters);
    latency is the prefill leg's.

Until issue 10's core lands the policies are not wired into the clients, so the calls go
through a thin harness: the issue-12 pools and policies (``route()``, the background
drivers) and one ``httpx.AsyncClient``; (a) sends decode legs only, (b) prefill legs only.

Run: PYTHONPATH=. python benchmarks/bench_fleet.py [--rounds 7] [--json run1.json] [--png benchmarks/results/fleet.png]
     PYTHONPATH=. python benchmarks/bench_fleet.py --report run1.json run2.json   # several runs' rounds together
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pdclient import _wire as wire
from pdclient._background import BackgroundTask
from pdclient._endpoints import BreakerSettings, EndpointPool, route
from pdclient._load import LoadAware, LoadScraper, ScrapeSettings
from pdclient._prefix_index import CacheAware, prompt_text
from pdclient._routing import Affinity, LeastOutstanding, RoundRobin, RouteRequest, RoutingPolicy

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "tests" / "stubserver.py"
# (a): three decode servers of 8 slots; a step (one streamed event) takes 10 ms + 4 ms per
# running request. The slow one is slow for one of two reasons:
FAST = ["--max-running", "8", "--step-seconds", "0.010", "--step-per-running", "0.004"]
SLOW = {
    # another tenant's long requests hold 6 of its 8 slots (and lengthen its steps)
    "tenant": [*FAST, "--background", "6"],
    # older hardware: every step 4x as long, and only these clients' calls on it
    "hardware": ["--max-running", "8", "--step-seconds", "0.040", "--step-per-running", "0.016"],
}
LOAD_ARMS = ("least_outstanding", "load_aware")
CACHE_ARMS = ("round_robin", "affinity", "cache_aware")
WORKLOADS = ("conversations", "shared")


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Stubs:
    """Stub servers, each in a process of its own (so none shares a GIL with a client)."""

    def __init__(self, argv_each: Sequence[Sequence[str]]) -> None:
        self.procs = []
        self.urls = []
        for argv in argv_each:
            proc = subprocess.Popen(
                [sys.executable, str(STUB), *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            line = proc.stdout.readline() if proc.stdout else ""
            if not line.startswith("READY "):
                raise RuntimeError(f"stub did not start: {line!r}")
            self.procs.append(proc)
            self.urls.append(line.split()[1])

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin:
                proc.stdin.close()
        for proc in self.procs:
            proc.wait(10)


# -- (a) load signals across processes ---------------------------------------------------------


async def client_a(policy_name: str, urls: list[str], calls: int, concurrency: int, seed: int) -> dict[str, Any]:
    """One client process of (a): returns its call latencies (ms) and where its calls went."""
    urls = list(urls)
    random.Random(seed).shuffle(urls)  # each process lists the servers in its own order
    pool = EndpointPool("decode", tuple(urls), LeastOutstanding(), BreakerSettings())
    driver = None
    policy: RoutingPolicy
    if policy_name == "load_aware":
        policy = LoadAware(rng=random.Random(seed))
        settings = ScrapeSettings()
        driver = BackgroundTask([LoadScraper(lambda: pool.endpoints, settings, leg="decode")])
    else:
        policy = LeastOutstanding()
    latencies: list[float] = []
    where: dict[str, int] = {}
    body = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "stream": True}
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=60, limits=limits) as http:
        if driver is not None:
            driver.start()
        for url in urls:  # connect and warm up every server once
            await http.get(url.removesuffix("/v1") + "/health")
        await asyncio.sleep(0.7)  # the first scrape is in
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # all clients start together
        queue = iter(range(calls))

        async def worker() -> None:
            for _ in queue:
                endpoint = route(pool, policy, RouteRequest("decode"))
                endpoint.acquire()
                started = time.perf_counter()
                try:
                    async with http.stream("POST", endpoint.url + "/chat/completions", json=body) as response:
                        async for _ in response.aiter_bytes():
                            pass
                finally:
                    endpoint.release(ok=True)
                latencies.append((time.perf_counter() - started) * 1000)
                where[endpoint.url] = where.get(endpoint.url, 0) + 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if driver is not None:
            await driver.aclose()
    return {"latencies": latencies, "where": where}


def run_load_round(arm: str, urls: list[str], args: argparse.Namespace, seed: int) -> dict[str, Any]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--client-a",
                arm,
                "--urls",
                ",".join(urls),
                "--calls",
                str(args.calls),
                "--concurrency",
                str(args.concurrency),
                "--seed",
                str(seed * 10 + i),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for i in range(args.clients)
    ]
    for proc in procs:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    latencies: list[float] = []
    where: dict[str, int] = {}
    for proc in procs:
        out, _ = proc.communicate(timeout=600)
        result = json.loads(out.strip().splitlines()[-1])
        latencies += result["latencies"]
        for url, n in result["where"].items():
            where[url] = where.get(url, 0) + n
    return {"latencies": latencies, "where": where}


def bench_load(args: argparse.Namespace) -> dict[str, dict[str, list[dict[str, Any]]]]:
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for scenario, slow_argv in SLOW.items():
        stubs = Stubs([FAST, FAST, slow_argv])
        slow = stubs.urls[2]
        rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in LOAD_ARMS}
        try:
            for r in range(args.rounds):
                for arm in LOAD_ARMS if r % 2 == 0 else LOAD_ARMS[::-1]:
                    result = run_load_round(arm, stubs.urls, args, seed=r)
                    lat = result["latencies"]
                    share = result["where"].get(slow, 0) / max(1, sum(result["where"].values()))
                    row = {
                        "p50": statistics.median(lat),
                        "p90": percentile(lat, 0.9),
                        "p99": percentile(lat, 0.99),
                        "mean": statistics.fmean(lat),
                        "slow_share": share,
                        "latencies": lat,
                    }
                    rounds[arm].append(row)
                    print(
                        f"  (a) {scenario:<8} round {r + 1} {arm:<18} p50 {row['p50']:6.1f} ms  "
                        f"p99 {row['p99']:7.1f} ms  calls on the slow server {share:5.1%}",
                        flush=True,
                    )
        finally:
            stubs.close()
        results[scenario] = rounds
    return results


# -- (b) prefix-cache-aware prefill routing ------------------------------------------------------


def words(rng: random.Random, n: int) -> str:
    vocab = ("the", "model", "cache", "prefill", "decode", "token", "server", "route", "prompt", "user", "answer")
    return " ".join(rng.choice(vocab) + str(rng.randrange(100)) for _ in range(n // 8))


@dataclass
class User:
    system: str
    turns: list[tuple[str, str]] = field(default_factory=list)
    """(user message, the assistant's answer to it)"""


def workload(kind: str, seed: int) -> list[User]:
    rng = random.Random(seed)
    if kind == "conversations":
        system = "You are a helpful assistant."
        return [
            User(system, [(words(rng, rng.randint(400, 800)), words(rng, rng.randint(600, 1200))) for _ in range(4)])
            for _ in range(48)
        ]
    systems = [f"Policy {i}: " + words(rng, 8000) for i in range(4)]
    return [
        User(
            rng.choice(systems),
            [(words(rng, rng.randint(200, 400)), words(rng, rng.randint(400, 800))) for _ in range(3)],
        )
        for _ in range(64)
    ]


def cache_counts(text: str) -> tuple[float, float]:
    def value(name: str) -> float:
        found = re.search(rf"^vllm:{name}_total\{{[^}}]*\}} (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    return value("prefix_cache_hits"), value("prefix_cache_queries")


async def run_cache(arm: str, kind: str, urls: list[str], seed: int, concurrency: int) -> dict[str, Any]:
    pool = EndpointPool("prefill", tuple(urls), LeastOutstanding(), BreakerSettings())
    policy: RoutingPolicy
    if arm == "cache_aware":
        policy = CacheAware()
    elif arm == "affinity":
        policy = Affinity()
    else:
        policy = RoundRobin()
    users = workload(kind, seed)
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=120) as http:
        for url in urls:
            await http.post(url.removesuffix("/v1") + "/stub/control", json={"reset_prefix_cache": True})
        gate = asyncio.Semaphore(concurrency)

        async def converse(user: User) -> None:
            async with gate:
                messages: list[dict[str, str]] = [{"role": "system", "content": user.system}]
                for question, answer in user.turns:
                    messages.append({"role": "user", "content": question})
                    body = {"model": "m", "messages": list(messages), "max_tokens": 1}
                    wants = getattr(policy, "wants_prompt_text", False)
                    request = RouteRequest(
                        "prefill",
                        affinity_key=wire.affinity_key(wire.Kind.CHAT, body["messages"], None, None),
                        prompt_text=prompt_text(body) if wants else None,
                    )
                    endpoint = route(pool, policy, request)
                    endpoint.acquire()
                    started = time.perf_counter()
                    try:
                        prefill = {**body, "kv_transfer_params": {"do_remote_decode": True}}
                        (await http.post(endpoint.url + "/chat/completions", json=prefill)).raise_for_status()
                    finally:
                        endpoint.release(ok=True)
                    latencies.append((time.perf_counter() - started) * 1000)
                    messages.append({"role": "assistant", "content": answer})

        await asyncio.gather(*(converse(u) for u in users))
        hits = queries = 0.0
        for url in urls:
            h, q = cache_counts((await http.get(url.removesuffix("/v1") + "/metrics")).text)
            hits, queries = hits + h, queries + q
    decisions = dict(policy.decisions) if isinstance(policy, CacheAware) else {}
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "p50": statistics.median(latencies),
        "p99": percentile(latencies, 0.99),
        "latencies": latencies,
        "decisions": decisions,
    }


def bench_cache(args: argparse.Namespace) -> dict[str, dict[str, list[dict[str, Any]]]]:
    cache = ["--prefix-cache-chars", str(args.cache_chars), "--prefill-seconds-per-char", "0.000005"]
    stubs = Stubs([cache, cache, cache])
    results: dict[str, dict[str, list[dict[str, Any]]]] = {k: {a: [] for a in CACHE_ARMS} for k in WORKLOADS}
    try:
        for r in range(args.rounds):
            for kind in WORKLOADS:
                arms = CACHE_ARMS[r % 3 :] + CACHE_ARMS[: r % 3]  # rotate the order every round
                for arm in arms:
                    out = asyncio.run(
                        run_cache(arm, kind, stubs.urls, seed=100 + r, concurrency=args.cache_concurrency)
                    )
                    results[kind][arm].append(out)
                    print(
                        f"  (b) round {r + 1} {kind:<13} {arm:<12} hit rate {out['hit_rate']:6.1%}  p50 "
                        f"{out['p50']:6.1f} ms  p99 {out['p99']:7.1f} ms {out['decisions'] or ''}",
                        flush=True,
                    )
    finally:
        stubs.close()
    return results


# -- report ------------------------------------------------------------------------------------------


def med(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(row[key] for row in rows)


def report(load: dict[str, dict[str, list[dict[str, Any]]]], cache: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    if load and all(rows for arms in load.values() for rows in arms.values()):
        report_load(load)
    if cache and all(rows for arms in cache.values() for rows in arms.values()):
        report_cache(cache)


def report_load(load: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    print("\n(a) 4 client processes x 3 calls in flight, 3 decode servers (1 slow); medians of per-round figures")
    print(
        f"{'slow because':<14}{'policy':<20}{'p50 ms':>9}{'p90 ms':>9}{'p99 ms':>9}{'mean ms':>9}"
        f"{'on slow':>9}{'p99 / LO':>10}"
    )
    for scenario, arms in load.items():
        base = med(arms["least_outstanding"], "p99")
        for arm, rows in arms.items():
            print(
                f"{scenario:<14}{arm:<20}{med(rows, 'p50'):>9.1f}{med(rows, 'p90'):>9.1f}{med(rows, 'p99'):>9.1f}"
                f"{med(rows, 'mean'):>9.1f}{med(rows, 'slow_share'):>9.1%}{med(rows, 'p99') / base:>10.2f}"
            )
        pairs = zip(arms["load_aware"], arms["least_outstanding"], strict=True)
        ratios = [a["p99"] / b["p99"] for a, b in pairs]
        print(f"{'':<14}per-round p99 ratio load_aware / least_outstanding: {', '.join(f'{x:.2f}' for x in ratios)}")


def report_cache(cache: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    print("\n(b) prefix cache: hit rate (cached / queried characters) and prefill latency; medians over rounds")
    print(f"{'workload':<15}{'policy':<14}{'hit rate':>10}{'p50 ms':>9}{'p99 ms':>9}{'hit / affinity':>16}")
    for kind, arms in cache.items():
        ref = med(arms["affinity"], "hit_rate")
        for arm, rows in arms.items():
            hit = med(rows, "hit_rate")
            print(f"{kind:<15}{arm:<14}{hit:>10.1%}{med(rows, 'p50'):>9.1f}{med(rows, 'p99'):>9.1f}{hit / ref:>16.3f}")


def plot(
    load: dict[str, dict[str, list[dict[str, Any]]]], cache: dict[str, dict[str, list[dict[str, Any]]]], path: Path
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    ax = axes[0]
    for j, (scenario, arms) in enumerate(load.items()):
        for i, arm in enumerate(LOAD_ARMS):
            ordered = sorted(x for row in arms[arm] for x in row["latencies"])
            fractions = [k / len(ordered) for k in range(len(ordered))]
            style = "-" if j == 0 else "--"
            ax.plot(ordered, fractions, style, label=f"{arm} (slow: {scenario})", color=f"C{i}")
    ax.set_xscale("log")
    ax.set_ylim(0.8, 1.0)
    ax.set_xlabel("call latency, ms (all rounds)")
    ax.set_ylabel("fraction of calls (top 20 %)")
    ax.set_title("(a) 4 processes, 3 decode servers, 1 slow")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    width = 0.25
    for panel, key, label in ((1, "hit_rate", "prefix-cache hit rate"), (2, "p99", "prefill p99, ms")):
        ax = axes[panel]
        for i, arm in enumerate(CACHE_ARMS):
            values = [med(cache[kind][arm], key) for kind in WORKLOADS]
            ax.bar([k + (i - 1) * width for k in range(len(WORKLOADS))], values, width, label=arm, color=f"C{i + 2}")
        ax.set_xticks(range(len(WORKLOADS)), WORKLOADS)
        ax.set_title(f"(b) {label}")
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nplot: {path}")


def merge(runs: Iterable[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Several saved runs as one: their rounds side by side."""
    load: dict[str, dict[str, list[Any]]] = {}
    cache: dict[str, dict[str, list[Any]]] = {}
    for run in runs:
        for merged, part in ((load, run["load"]), (cache, run["cache"])):
            for group, arms in part.items():
                for arm, rows in arms.items():
                    merged.setdefault(group, {}).setdefault(arm, []).extend(rows)
    return load, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--clients", type=int, default=4, help="(a) client processes")
    parser.add_argument("--calls", type=int, default=100, help="(a) calls per client process per round")
    parser.add_argument("--concurrency", type=int, default=3, help="(a) calls in flight per client process")
    parser.add_argument("--cache-chars", type=int, default=32_000, help="(b) prefix cache per prefill server")
    parser.add_argument("--cache-concurrency", type=int, default=8, help="(b) conversations in flight")
    parser.add_argument("--only", choices=("load", "cache"), default=None)
    parser.add_argument("--png", type=Path, default=ROOT / "benchmarks" / "results" / "fleet.png")
    parser.add_argument("--json", type=Path, default=None, help="write the samples here")
    parser.add_argument("--report", type=Path, nargs="+", default=None, help="report and plot saved runs, merged")
    parser.add_argument("--client-a", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--urls", default="", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client_a:
        result = asyncio.run(client_a(args.client_a, args.urls.split(","), args.calls, args.concurrency, args.seed))
        print(json.dumps(result), flush=True)
        return
    if args.report:
        load, cache = merge(json.loads(path.read_text()) for path in args.report)
        report(load, cache)
        plot(load, cache, args.png)
        return
    load = bench_load(args) if args.only != "cache" else {}
    cache = bench_cache(args) if args.only != "load" else {}
    report(load, cache)
    if args.only is None:
        plot(load, cache, args.png)
    if args.json:
        args.json.write_text(json.dumps({"load": load, "cache": cache}))


if __name__ == "__main__":
    main()
