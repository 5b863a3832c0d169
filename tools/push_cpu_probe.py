"""Where a push-mode call's CPU goes: per-thread CPU of both servers, sequential vs concurrent.

    flock /tmp/pdclient-vllm.lock python tools/push_cpu_probe.py     # SIZE=1000 ROUNDS=2

Starts ``LocalPD(kv_connector="nixl-push")`` (prefill and decode each on its core), warms
up, then sends one ~SIZE-token prompt per arm and round, streamed, while a thread reads
``/proc/<pid>/task/<tid>/stat`` of both servers' process trees every 50 ms. Prints per
call the client TTFT, how the call went (its trace's dispatch and fall-back) and the CPU
seconds each process/thread name used, split by the core it ran on. Used for the
"Where the time went" notes in docs/benchmarks.md (with ``py-spy dump`` by hand).
"""

from __future__ import annotations

import collections
import os
import random
import threading
import time

import httpx

from pdclient import PDTrace
from pdclient.cli.bench import Prompts
from pdclient.local import LocalPD

TICKS = os.sysconf("SC_CLK_TCK")
SIZE = int(os.environ.get("SIZE", "1000"))
ROUNDS = int(os.environ.get("ROUNDS", "2"))
Usage = dict[tuple[str, str, int], float]


def process_tree(root: int) -> list[int]:
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    children[int(stat.read().rsplit(")", 1)[1].split()[1])].append(int(entry))
            except OSError:
                continue
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def thread_cpu(role: str, root: int) -> dict[tuple[str, int], tuple[str, float, int]]:
    """(role, tid) -> (process/thread name, CPU seconds so far, core it last ran on)."""
    snapshot = {}
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/comm") as comm:
                process = comm.read().strip()
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as stat:
                    text = stat.read()
            except OSError:
                continue
            fields = text.rsplit(")", 1)[1].split()
            name = text[text.index("(") + 1 : text.rindex(")")]
            seconds = (int(fields[11]) + int(fields[12])) / TICKS
            snapshot[(role, int(tid))] = (f"{process}/{name}", seconds, int(fields[36]))
    return snapshot


class Sampler(threading.Thread):
    def __init__(self, roots: dict[str, int]) -> None:
        super().__init__(daemon=True)
        self.roots, self.done = roots, threading.Event()
        self.usage: Usage = collections.defaultdict(float)

    def snapshot(self) -> dict[tuple[str, int], tuple[str, float, int]]:
        return {k: v for role, root in self.roots.items() for k, v in thread_cpu(role, root).items()}

    def run(self) -> None:
        before = self.snapshot()
        while not self.done.wait(0.05):
            now = self.snapshot()
            for key, (name, seconds, core) in now.items():
                if key in before and seconds > before[key][1]:
                    self.usage[(key[0], name, core)] += seconds - before[key][1]
            before = now


def report(usage: Usage) -> None:
    by_name: dict[tuple[str, str], dict[int, float]] = collections.defaultdict(lambda: collections.defaultdict(float))
    for (role, name, core), seconds in usage.items():
        by_name[(role, name)][core] += seconds
    for (role, name), cores in sorted(by_name.items(), key=lambda kv: -sum(kv[1].values()))[:12]:
        split = {core: round(s, 2) for core, s in sorted(cores.items())}
        print(f"  {role:8s} {name:36s} {sum(cores.values()):6.2f} s CPU, by core {split}")


def main() -> None:
    with LocalPD(kv_connector="nixl-push", max_model_len=SIZE + 768) as pd:
        assert pd.prefill is not None and pd.decode is not None and pd.prefill.pid and pd.decode.pid
        print(f"cores {pd.cpus}, logs {[str(p) for p in pd.logs]}", flush=True)
        traces: list[PDTrace] = []
        concurrent = pd.client(
            dispatch="concurrent",
            remote_prefill="always",
            on_trace=traces.append,
            max_retries=0,
            timeout=httpx.Timeout(180.0, connect=10.0),
        )
        clients = {"concurrent": concurrent, "sequential": concurrent.with_options(dispatch="sequential")}
        prompts = Prompts(random.Random(0))

        def send(arm: str) -> float | None:
            start, first = time.perf_counter(), None
            stream = clients[arm].chat.completions.create(
                model=pd.model,
                messages=[{"role": "user", "content": prompts.make(SIZE)}],
                max_tokens=4,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for chunk in stream:
                if first is None and chunk.choices and chunk.choices[0].delta.content:
                    first = time.perf_counter() - start
            return first

        for _ in range(2):  # connections, handshakes, the words-per-token ratio
            send("sequential")
            prompts.calibrate(SIZE, traces[-1].forwarded_tokens)
        send("concurrent")  # the client learns the prefill's coordinates
        for r in range(ROUNDS):
            for arm in ("sequential", "concurrent"):
                traces.clear()
                sampler = Sampler({"prefill": pd.prefill.pid, "decode": pd.decode.pid})
                sampler.start()
                ttft = send(arm)
                sampler.done.set()
                sampler.join()
                trace = traces[-1]
                print(f"\nround {r} {arm}: TTFT {ttft} s; dispatch {trace.dispatch}; fall-back {trace.fallback}")
                report(sampler.usage)


if __name__ == "__main__":
    main()
