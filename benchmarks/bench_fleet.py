"""Fleet routing through the real clients: load signals across client processes,
cache-aware prefill routing.

(a) Load: four client processes (``AsyncPDChatClient`` each) share one stub prefill server
    and three stub decode servers (tests/stubserver.py, each in a process of its own) of 8
    slots each; a decode step (one streamed event) takes 10 ms + 4 ms per running request,
    and KV usage is running / 8. One decode server is slow, in one of two ways: ``tenant``,
    another tenant's long requests hold 6 of its slots (and lengthen its steps), which no
    client process can see from its own calls; ``hardware``, every step takes 4x as long,
    and only these clients use it. Each process keeps ``--concurrency`` streamed chat calls
    going and lists the decode servers in its own order (as DNS or per-host configs hand
    them out, so least-outstanding's first-listed tie-break is no fixed preference). Arms:
    ``decode_routing="least_outstanding"`` (each process's own in-flight counts) and
    ``decode_routing="load_aware"`` (which turns the scraper on: each process reads the
    decode servers' /metrics with the default ScrapeSettings, every 0.5 s, fresh for 2 s;
    its scores weighted by each server's latency as this process saw it), and
    ``load_aware_counts``, ``LoadAware(latency=False)``: the servers' counts alone.
    Latency is the whole call, ``create()`` to the stream's end. Rounds interleave.

(b) Prefix cache: one ``AsyncPDChatClient``, three stub prefill servers that model a prefix
    cache (LRU, ``--cache-chars`` per server, 5 us per uncached character, one prefill at
    a time) and one stub decode server. Two workloads: ``conversations`` (48 chats of 4
    turns, no shared prefix beyond a one-line system message) and ``shared`` (64 users, 3
    turns each, each chat opening with one of 4 system prompts of 8000 characters), 8 chats
    in flight. Arms: ``prefill_routing=`` ``"round_robin"``, ``"affinity"`` (rendezvous on
    the conversation's opening) and ``"cache_aware"``. Hit rate is the stubs' own count
    (cached / queried characters, from their /metrics); latency is ``PDTrace.prefill_ms``;
    the cache-aware rules that decided come from ``PDTrace.prefill_route``.

Run: python benchmarks/bench_fleet.py [--rounds 5] [--json run1.json] [--png benchmarks/results/fleet.png]
     python benchmarks/bench_fleet.py --report run1.json run2.json   # several runs' rounds together
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

from pdclient import AsyncPDChatClient, LoadAware, PDTrace

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
LOAD_ARMS = ("least_outstanding", "load_aware_counts", "load_aware")
# what each arm passes as decode_routing
LOAD_POLICIES: dict[str, Any] = {"load_aware_counts": lambda: LoadAware(latency=False)}
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


async def client_a(arm: str, prefill: str, urls: list[str], calls: int, concurrency: int, seed: int) -> dict[str, Any]:
    """One client process of (a): its call latencies (ms) and where its decode legs went."""
    urls = list(urls)
    random.Random(seed).shuffle(urls)  # each process lists the servers in its own order
    traces: list[PDTrace] = []
    client = AsyncPDChatClient(
        prefill_base_url=prefill,
        decode_base_url=urls,
        decode_routing=LOAD_POLICIES[arm]() if arm in LOAD_POLICIES else arm,
        remote_prefill="always",  # what is measured is where each handoff goes
        api_key="-",
        max_retries=0,
        timeout=60,
        on_trace=traces.append,
    )
    messages = [{"role": "user", "content": "hello"}]
    latencies: list[float] = []
    async with client:
        for _ in range(2 * len(urls)):  # connect to the servers; the driver starts with the first call
            stream = await client.chat.completions.create(model="m", messages=messages, stream=True)  # type: ignore[arg-type]
            async for _chunk in stream:
                pass
        await asyncio.sleep(0.7)  # the first scrape is in
        traces.clear()
        print("ready", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # all clients start together
        queue = iter(range(calls))

        async def worker() -> None:
            for _ in queue:
                started = time.perf_counter()
                stream = await client.chat.completions.create(model="m", messages=messages, stream=True)  # type: ignore[arg-type]
                async for _chunk in stream:
                    pass
                latencies.append((time.perf_counter() - started) * 1000)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    where: dict[str, int] = {}
    for trace in traces:
        where[str(trace.decode_url)] = where.get(str(trace.decode_url), 0) + 1
    return {"latencies": latencies, "where": where}


def run_load_round(arm: str, prefill: str, urls: list[str], args: argparse.Namespace, seed: int) -> dict[str, Any]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--client-a",
                arm,
                "--prefill",
                prefill,
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
        stubs = Stubs([FAST, FAST, slow_argv, []])  # the last one is the prefill server
        decodes, prefill = stubs.urls[:3], stubs.urls[3]
        slow = decodes[2]
        rounds: dict[str, list[dict[str, Any]]] = {arm: [] for arm in LOAD_ARMS}
        try:
            for r in range(args.rounds):
                for arm in LOAD_ARMS if r % 2 == 0 else LOAD_ARMS[::-1]:
                    result = run_load_round(arm, prefill, decodes, args, seed=r)
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


async def run_cache(arm: str, kind: str, urls: list[str], decode: str, seed: int, concurrency: int) -> dict[str, Any]:
    users = workload(kind, seed)
    traces: list[PDTrace] = []
    client = AsyncPDChatClient(
        prefill_base_url=urls,
        decode_base_url=decode,
        prefill_routing=arm,
        remote_prefill="always",  # every turn's prefill is routed: what is measured
        api_key="-",
        max_retries=0,
        timeout=120,
        on_trace=traces.append,
    )
    async with httpx.AsyncClient(timeout=120) as http, client:
        for url in urls:
            await http.post(url.removesuffix("/v1") + "/stub/control", json={"reset_prefix_cache": True})
        gate = asyncio.Semaphore(concurrency)

        async def converse(user: User) -> None:
            async with gate:
                messages: list[dict[str, str]] = [{"role": "system", "content": user.system}]
                for question, answer in user.turns:
                    messages.append({"role": "user", "content": question})
                    await client.chat.completions.create(model="m", messages=list(messages), max_tokens=1)  # type: ignore[arg-type]
                    messages.append({"role": "assistant", "content": answer})

        await asyncio.gather(*(converse(u) for u in users))
        hits = queries = 0.0
        for url in urls:
            h, q = cache_counts((await http.get(url.removesuffix("/v1") + "/metrics")).text)
            hits, queries = hits + h, queries + q
    latencies = [t.prefill_ms for t in traces if t.prefill_ms is not None]
    rules: dict[str, int] = {}
    for trace in traces:
        route = (trace.prefill_route or "").split()[0]
        rule = route.partition("/")[2]
        if rule:
            rules[rule] = rules.get(rule, 0) + 1
    return {
        "hit_rate": hits / queries if queries else 0.0,
        "p50": statistics.median(latencies),
        "p99": percentile(latencies, 0.99),
        "latencies": latencies,
        "decisions": rules if arm == "cache_aware" else {},
    }


def bench_cache(args: argparse.Namespace) -> dict[str, dict[str, list[dict[str, Any]]]]:
    cache = ["--prefix-cache-chars", str(args.cache_chars), "--prefill-seconds-per-char", "0.000005"]
    stubs = Stubs([cache, cache, cache, []])  # three prefill servers and a decode server
    results: dict[str, dict[str, list[dict[str, Any]]]] = {k: {a: [] for a in CACHE_ARMS} for k in WORKLOADS}
    try:
        for r in range(args.rounds):
            for kind in WORKLOADS:
                arms = CACHE_ARMS[r % 3 :] + CACHE_ARMS[: r % 3]  # rotate the order every round
                for arm in arms:
                    out = asyncio.run(
                        run_cache(
                            arm, kind, stubs.urls[:3], stubs.urls[3], seed=100 + r, concurrency=args.cache_concurrency
                        )
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
        ratio = med(arms["load_aware"], "p99") / base
        verdict = "met" if ratio <= 0.7 else "NOT met"
        print(f"{'':<14}target p99 load_aware / least_outstanding <= 0.70: {ratio:.2f}, {verdict}")


def report_cache(cache: dict[str, dict[str, list[dict[str, Any]]]]) -> None:
    print("\n(b) prefix cache: hit rate (cached / queried characters) and prefill latency; medians over rounds")
    print(f"{'workload':<15}{'policy':<14}{'hit rate':>10}{'p50 ms':>9}{'p99 ms':>9}{'hit / affinity':>16}")
    for kind, arms in cache.items():
        ref = med(arms["affinity"], "hit_rate")
        for arm, rows in arms.items():
            hit = med(rows, "hit_rate")
            print(f"{kind:<15}{arm:<14}{hit:>10.1%}{med(rows, 'p50'):>9.1f}{med(rows, 'p99'):>9.1f}{hit / ref:>16.3f}")
        ratio = med(arms["cache_aware"], "hit_rate") / ref
        if kind == "conversations":
            verdict = "met" if ratio >= 0.9 else "NOT met"
            print(f"{'':<15}target cache_aware hit rate within 10 % of affinity's: {ratio:.3f}, {verdict}")
        else:
            verdict = "met" if ratio > 1 else "NOT met"
            print(f"{'':<15}target cache_aware hit rate above affinity's: {ratio:.3f}, {verdict}")


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
    parser.add_argument("--prefill", default="", help=argparse.SUPPRESS)
    parser.add_argument("--urls", default="", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client_a:
        result = asyncio.run(
            client_a(args.client_a, args.prefill, args.urls.split(","), args.calls, args.concurrency, args.seed)
        )
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
