"""NIXL on a small CPU host: two of its habits that cost a core the model needs.

1. Progress thread. NIXL's Python API hard-codes ``pthrDelay = 0``, so every vLLM worker
   with the NIXL connector keeps one thread at 100 % of a core even when idle. On a GPU
   host that buys transfer latency on a spare core. On a small CPU host it shares the
   core the model computes on: measured here, a prefill of 1.8k tokens took 23 s next to
   it and 4 s without. ``slow_progress_thread`` makes it sleep between rounds.
2. KV thread placement. On CPU, vLLM's NIXL worker moves its main thread (which also runs
   the model when OMP has one thread) to the last core of each NUMA node of the whole
   machine, ignoring ``VLLM_CPU_OMP_THREADS_BIND``. Two servers on one host, each bound to
   its own core, then both compute on the last core. ``keep_kv_thread_on`` limits that
   choice to the given CPUs.

vLLM loads NIXL lazily (``vllm.distributed.nixl_utils``), after setting UCX's environment,
so these hook vLLM's loader and platform instead of importing NIXL themselves.
"""

from __future__ import annotations

import sys
from typing import Any

PATCHED = "__pdclient_nixl_cpu__"


def slow_progress_thread(delay_us: int) -> str:
    try:
        from vllm.distributed import nixl_utils
    except ImportError:
        return "skipped (this vLLM has no vllm.distributed.nixl_utils)"
    on = f"on (progress thread sleeps {delay_us} us between rounds)"
    load = getattr(nixl_utils, "_load_nixl_attr", None)
    if load is None:
        # vLLM < 0.26 imports NIXL as nixl_utils loads (after setting UCX's environment).
        wrapper = getattr(nixl_utils, "NixlWrapper", None)
        if wrapper is None:
            return "skipped (NIXL is not installed)"
        _set_progress_delay(sys.modules[wrapper.__module__], delay_us)
        return on
    if getattr(load, PATCHED, None) is not None:
        return on

    def load_nixl_attr(name: str) -> Any:
        value = load(name)
        if name == "NixlWrapper" and value is not None:
            _set_progress_delay(sys.modules[value.__module__], delay_us)
        return value

    setattr(load_nixl_attr, PATCHED, delay_us)
    nixl_utils._load_nixl_attr = load_nixl_attr
    return on


def _set_progress_delay(api: Any, delay_us: int) -> None:
    """Make ``api.nixl_agent`` build its config with ``pthrDelay = delay_us``, not 0."""
    bind = api.nixlBind
    base = bind.nixlAgentConfig
    if getattr(base, PATCHED, None) is not None:
        return

    class AgentConfig(base):  # type: ignore[misc, valid-type]
        def __setattr__(self, name: str, value: Any) -> None:
            # Only NIXL's hard-coded spin: a delay someone chose on purpose stays.
            if name == "pthrDelay" and value == 0:
                value = delay_us
            super().__setattr__(name, value)

    setattr(AgentConfig, PATCHED, delay_us)
    bind.nixlAgentConfig = AgentConfig


def keep_kv_thread_on(cpus: set[int]) -> str:
    """vLLM puts the NIXL worker's thread on ``max`` of each NUMA node's cores: keep only ``cpus``."""
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:
        return "skipped (this vLLM has no CpuPlatform)"
    discover = getattr(CpuPlatform, "discover_numa_topology", None)
    if discover is None:
        return "skipped (this vLLM does not place the NIXL thread: no discover_numa_topology)"
    on = f"on (NIXL worker thread kept on CPUs {sorted(cpus)})"
    if getattr(discover, PATCHED, None) is not None:
        return on

    def discover_numa_topology(cls: type) -> list[list[int]]:
        nodes = [[cpu for cpu in node if cpu in cpus] for node in discover()]
        # One list per NUMA node that has any of ours; vLLM takes the max of each.
        return [node for node in nodes if node] or [sorted(cpus)]

    setattr(discover_numa_topology, PATCHED, sorted(cpus))
    CpuPlatform.discover_numa_topology = classmethod(discover_numa_topology)  # type: ignore[method-assign, assignment]
    return on


def parse_cpu_list(text: str) -> set[int]:
    """``"0"``, ``"0-3,8"`` -> CPU ids; ValueError on anything else."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(text)
        cpus.update(range(int(low), int(high if dash else low) + 1))
    return cpus
