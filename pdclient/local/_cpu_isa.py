"""Run LocalPD's servers as a CPU with fewer instruction sets would.

The same model gives different greedy answers with and without AVX-512 or its bf16
instructions (vLLM loads another kernel library, oneDNN and ATen take other paths), so a
test that passes on one CPU can fail on another only because of what the model says.
``LocalPD(cpu_isa="avx2")`` (or ``$PDCLIENT_SERVER_CPU_ISA``) starts its servers as an
AVX2-only CPU would compute, ``"avx512"`` as one without AVX-512 bf16 or AMX: a machine
with more can run the real-pair tests as a machine with less would. It only takes
instruction sets away: asking for one the CPU lacks is an error.

The dtype goes with the instruction sets (``server_dtype``): bf16 where the CPU computes it
natively, float32 where it would only emulate it, a few times slower.
"""

from __future__ import annotations

import os
from pathlib import Path

from .._errors import PDConfigError

CPU_ISA_ENV = "PDCLIENT_SERVER_CPU_ISA"
EMULATED_ISA_ENV = "PDCLIENT_EMULATED_CPU_ISA"
"""Set in a server's environment when it computes as a CPU with only that set (sitecustomize reads it)."""
_NATIVE_BF16 = {"avx512_bf16", "amx_bf16"}
SITE = Path(__file__).with_name("_cpu_isa_site")

# oneDNN's and ATen's own caps, beside the probes sitecustomize turns off.
_CAPS = {
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512"},
}
_NEEDS = {"avx2": "avx2", "avx512": "avx512f"}


def cpu_isa_from_env() -> str | None:
    return os.environ.get(CPU_ISA_ENV) or None


def cpu_isa_env(isa: str | None) -> dict[str, str]:
    """The server environment that makes vLLM compute as a CPU with only ``isa`` would."""
    if isa is None:
        return {}
    if isa not in _CAPS:
        raise PDConfigError(f"cpu_isa={isa!r} (or ${CPU_ISA_ENV}): expected one of {sorted(_CAPS)} or None")
    flags = _cpu_flags()
    if flags is not None and _NEEDS[isa] not in flags:
        raise PDConfigError(f"cpu_isa={isa!r}: this CPU has no {_NEEDS[isa]}; it can only take instruction sets away")
    return {"PYTHONPATH": str(SITE), EMULATED_ISA_ENV: isa, **_CAPS[isa]}


def server_dtype(emulated_isa: str | None) -> str:
    """The dtype vLLM computes in on this CPU, or as one with only ``emulated_isa`` would.

    bfloat16 where the CPU has bf16 instructions (AVX-512 BF16, AMX). Elsewhere ATen and
    oneDNN emulate them, and float32 is the faster: on a Zen 1 EPYC (AVX2) a 1,800-token
    prefill took 88 s in bf16 and 22 s in fp32, and decoding went 6.4 against 8.5 tokens/s
    (torch's linear alone: 3.2 against 17.6 GFLOP/s). A CPU capped to fewer sets
    (``cpu_isa``) has none of them, so it computes in float32 as such a CPU does.
    """
    if emulated_isa is not None:
        return "float32"
    flags = _cpu_flags()
    return "bfloat16" if flags is None or flags & _NATIVE_BF16 else "float32"


def _cpu_flags() -> set[str] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return None
