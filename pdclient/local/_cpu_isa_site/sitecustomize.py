"""Run by Python at the start of every process of a vLLM server that ``LocalPD`` started
with ``cpu_isa``: torch's CPU feature probes answer as that CPU's would, before vLLM asks
them which of its kernel libraries to load (``_C``, ``_C_AVX512``, ``_C_AVX2``) and
which bf16 paths to take. oneDNN and ATen are capped by their own variables, set beside
this one (``local._cpu_isa``)."""

from __future__ import annotations

import importlib
import os

_LACKING = {
    "avx2": ("avx512", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_fp16"),
    "avx512": ("avx512_bf16", "amx_tile", "amx_fp16"),
}


def _emulate(isa: str) -> None:
    cpu = importlib.import_module("torch.cpu")
    for feature in _LACKING[isa]:
        probe = f"_is_{feature}_supported"
        if hasattr(cpu, probe):
            setattr(cpu, probe, lambda: False)


if os.environ.get("PDCLIENT_EMULATED_CPU_ISA") in _LACKING:
    _emulate(os.environ["PDCLIENT_EMULATED_CPU_ISA"])
