"""What a P/D proxy costs in CPU when no call comes, and per call at a slow pace, on one LocalPD pair.

    python benchmarks/bench_idle_cpu.py                                 # pdclient serve vs vllm-router
    python benchmarks/bench_idle_cpu.py --against /work/main            # and another checkout's serve
    python benchmarks/bench_idle_cpu.py --serve-args="--remote-prefill auto"
    python benchmarks/bench_idle_cpu.py --stubs --against /work/main        # no vLLM: two stub servers

At the pace of vLLM's multi-turn benchmark on this pair (~0.4 calls a second per proxy)
the work a proxy does whether or not calls come (health probes, ``/metrics`` scrapes, KV
events) is charged to every call: CPU per call = per-call work + idle CPU per second /
calls per second. This measures the two apart. Every proxy stays up, polling the same
pair, the whole run; each round measures each proxy's idle CPU (its own process and
children, /proc's user+system) over ``--idle`` seconds, all proxies over the same window,
then sends each proxy, in turn, ``--calls`` streamed chat calls (a unique prompt of ~600
tokens, 16 answer tokens, one at a time) and divides its CPU over them. Rounds rotate the
proxies' order. Printed: medians over rounds.

``--stubs`` puts two stub servers (tests/stubserver.py: 40 events 20 ms apart) in the pair's
place: with no vLLM busy beside it, a sleeping process's wake-up costs most (~200 us each on
a 2-core Zen 1 EPYC VM, against ~35 us with the pair running), so what wakes an idle proxy
shows.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
from bench_proxies import Proc, log, pdclient_serve, stub, vllm_router

from pdclient.local import LocalPD

PROMPT_WORDS = 450  # ~600 tokens of SmolLM2's tokenizer
PROMPT_TOKENS = 600  # what a stub's prefill answers with


def one_call(client: httpx.Client, proc: Proc, model: str) -> None:
    words = " ".join(f"w{i}" for i in range(PROMPT_WORDS))
    body = {
        "model": model,
        "messages": [{"role": "user", "content": f"{uuid.uuid4().hex} {words}"}],
        "max_tokens": 16,
        "stream": True,
    }
    with client.stream("POST", proc.url + "/chat/completions", json=body, timeout=120) as response:
        response.raise_for_status()
        for _ in response.iter_bytes():
            pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle", type=float, default=20.0, help="seconds of each idle window")
    parser.add_argument("--calls", type=int, default=8, help="calls per proxy per round")
    parser.add_argument("--against", type=Path, help="another checkout whose `pdclient serve` is measured too")
    parser.add_argument("--serve-args", default="", help="extra flags for every `pdclient serve`, one string")
    parser.add_argument("--no-router", action="store_true")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    parser.add_argument("--stubs", action="store_true", help="two stub servers instead of a LocalPD pair")
    args = parser.parse_args()
    serve_args = args.serve_args.split()
    logs = Path(tempfile.mkdtemp(prefix="idle-cpu-"))
    idle: dict[str, list[float]] = {}
    per_call: dict[str, list[float]] = {}
    with contextlib.ExitStack() as stack:
        if args.stubs:
            prefill = stack.enter_context(stub(PROMPT_TOKENS, answer_tokens=40, step_ms=20))
            decode = stack.enter_context(stub(PROMPT_TOKENS, answer_tokens=40, step_ms=20))
            model = httpx.get(prefill + "/models").json()["data"][0]["id"]
        else:
            pd = stack.enter_context(LocalPD())
            prefill, decode, model = pd.prefill_url, pd.decode_url, pd.model
        starts: dict[str, Callable[[], contextlib.AbstractContextManager[Proc]]] = {
            "pdclient serve": lambda: pdclient_serve(prefill, decode, logs, extra_args=serve_args),
        }
        if args.against is not None:
            against = args.against.resolve()
            starts[f"pdclient serve ({against})"] = lambda: pdclient_serve(
                prefill, decode, logs, tree=against, name="pdclient serve against", extra_args=serve_args
            )
        if not args.no_router:
            starts["vllm-router"] = lambda: vllm_router(prefill, decode, logs)
        procs = {name: stack.enter_context(start()) for name, start in starts.items()}
        client = stack.enter_context(httpx.Client())
        for proc in procs.values():  # first calls open connections, import lazily: not measured
            one_call(client, proc, model)
        names = list(procs)
        for round_ in range(args.rounds):
            time.sleep(2.0)
            before = {n: procs[n].cpu_seconds() for n in names}
            started = time.monotonic()
            time.sleep(args.idle)
            elapsed = time.monotonic() - started
            for n in names:
                idle.setdefault(n, []).append((procs[n].cpu_seconds() - before[n]) / elapsed)
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for n in order:
                cpu = procs[n].cpu_seconds()
                for _ in range(args.calls):
                    one_call(client, procs[n], model)
                per_call.setdefault(n, []).append((procs[n].cpu_seconds() - cpu) * 1000 / args.calls)
            log(
                f"round {round_ + 1}: "
                + "; ".join(f"{n}: idle {idle[n][-1] * 1000:.2f} ms/s, {per_call[n][-1]:.2f} ms/call" for n in names)
            )
    result = {
        n: {
            "idle_cpu_ms_per_s": statistics.median(idle[n]) * 1000,
            "cpu_ms_per_call_back_to_back": statistics.median(per_call[n]),
            "idle_runs": [x * 1000 for x in idle[n]],
            "per_call_runs": per_call[n],
        }
        for n in names
    }
    for n, r in result.items():
        print(f"{n}: idle {r['idle_cpu_ms_per_s']:.2f} ms CPU/s, {r['cpu_ms_per_call_back_to_back']:.2f} ms CPU/call")
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    print(f"logs: {logs}", file=sys.stderr)


if __name__ == "__main__":
    main()
