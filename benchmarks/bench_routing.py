"""Routing policies on uneven servers: p50/p99 call latency side by side.

Three loopback stub pairs (tests/stubserver.py) stand for three prefill and three
decode servers; one decode server is slow (each SSE event takes 100 ms there instead of
1 ms), as a server with a long batch or a noisy neighbour would be. The same workload of
streamed chat calls at a fixed concurrency runs under each policy, rounds interleaved
(RR, LO, P2, RR, LO, P2, ...) so machine noise hits all of them alike.

Run: PYTHONPATH=. python benchmarks/bench_routing.py [--calls 300] [--rounds 3] [--concurrency 24]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

from pdclient import AsyncPDChatClient
from tests.stubserver import Fault, Received, StubServer

POLICIES = ("round_robin", "least_outstanding", "power_of_two")
FAST_EVENTS = Fault(event_delay=0.001)
SLOW_EVENTS = Fault(event_delay=0.100)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def run_policy(policy: str, prefills: list[str], decodes: list[str], calls: int, concurrency: int) -> list[float]:
    client = AsyncPDChatClient(
        prefill_base_url=prefills, decode_base_url=decodes, api_key="-", routing=policy, remote_prefill="always"
    )
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(i: int) -> None:
        async with gate:
            started = time.perf_counter()
            stream = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"call {i}"}], stream=True
            )
            async for _ in stream:
                pass
            latencies.append((time.perf_counter() - started) * 1000)

    await asyncio.gather(*(one(i) for i in range(calls)))
    await client.close()
    return latencies


async def main(calls: int, rounds: int, concurrency: int) -> None:
    servers = [StubServer(prompt_tokens=256, record=False).start() for _ in range(6)]
    prefill_servers, decode_servers = servers[:3], servers[3:]
    slow = decode_servers[0]
    for server in decode_servers:
        speed = SLOW_EVENTS if server is slow else FAST_EVENTS

        def hook(received: Received, speed: Fault = speed) -> Fault | None:
            return speed if received.leg == "decode" else None

        server.fault_hook = hook
    results: dict[str, list[float]] = {p: [] for p in POLICIES}
    try:
        for _ in range(rounds):
            for policy in POLICIES:
                prefills = [s.url for s in prefill_servers]
                decodes = [s.url for s in decode_servers]
                results[policy] += await run_policy(policy, prefills, decodes, calls, concurrency)
    finally:
        for server in servers:
            server.stop()
    baseline = percentile(results["round_robin"], 0.99)
    print(f"{calls * rounds} calls per policy, concurrency {concurrency}, 1 of 3 decode servers 100x slower per event")
    print(f"{'policy':<20}{'p50 ms':>10}{'p90 ms':>10}{'p99 ms':>10}{'mean ms':>10}{'p99 / round robin':>20}")
    for policy, values in results.items():
        p99 = percentile(values, 0.99)
        row = f"{statistics.median(values):>10.1f}{percentile(values, 0.9):>10.1f}{p99:>10.1f}"
        print(f"{policy:<20}{row}{statistics.fmean(values):>10.1f}{p99 / baseline:>20.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=24)
    args: Any = parser.parse_args()
    asyncio.run(main(args.calls, args.rounds, args.concurrency))
