"""LocalPD's ``cpu_isa``: the server environment that computes as a smaller CPU would."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from pdclient import PDConfigError
from pdclient.local import _cpu_isa
from pdclient.local._cpu_isa import CPU_ISA_ENV, cpu_isa_env, cpu_isa_from_env, server_dtype


def test_no_isa_changes_nothing() -> None:
    assert cpu_isa_env(None) == {}


def test_an_isa_caps_onednn_aten_and_the_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpu_isa, "_cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    env = cpu_isa_env("avx2")
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["ATEN_CPU_CAPABILITY"] == "avx2"
    assert env["PDCLIENT_EMULATED_CPU_ISA"] == "avx2"
    assert (Path(env["PYTHONPATH"]) / "sitecustomize.py").is_file()
    assert cpu_isa_env("avx512")["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE"


def test_an_unknown_isa_or_one_this_cpu_lacks_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(PDConfigError, match=rf"cpu_isa='sse2' \(or \${CPU_ISA_ENV}\): expected one of"):
        cpu_isa_env("sse2")
    monkeypatch.setattr(_cpu_isa, "_cpu_flags", lambda: {"avx2"})
    with pytest.raises(PDConfigError, match="this CPU has no avx512f; it can only take instruction sets away"):
        cpu_isa_env("avx512")


@pytest.mark.parametrize(
    ("flags", "emulated", "dtype"),
    [
        ({"avx2", "avx512f", "avx512_bf16"}, None, "bfloat16"),
        ({"avx2", "avx512f", "amx_bf16"}, None, "bfloat16"),
        ({"avx2", "avx512f"}, None, "float32"),  # AVX-512 without its bf16 emulates it
        ({"avx2"}, None, "float32"),
        ({"avx2", "avx512f", "avx512_bf16"}, "avx512", "float32"),  # capped: as such a CPU computes
        (None, None, "bfloat16"),  # no /proc/cpuinfo: vLLM's own default
    ],
)
def test_the_dtype_is_bf16_only_where_the_cpu_computes_it(
    monkeypatch: pytest.MonkeyPatch, flags: set[str] | None, emulated: str | None, dtype: str
) -> None:
    monkeypatch.setattr(_cpu_isa, "_cpu_flags", lambda: flags)
    assert server_dtype(emulated) == dtype


def test_the_isa_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(CPU_ISA_ENV, raising=False)
    assert cpu_isa_from_env() is None
    monkeypatch.setenv(CPU_ISA_ENV, "avx2")
    assert cpu_isa_from_env() == "avx2"


def test_sitecustomize_turns_the_probes_off_before_anything_else_runs(tmp_path: Path) -> None:
    """A stand-in ``torch.cpu`` whose probes say yes: a fresh interpreter with the site on its
    path finds them saying no, as vLLM's ``import_kernels`` will."""
    torch = tmp_path / "torch"
    torch.mkdir()
    (torch / "__init__.py").write_text("")
    probes = ("avx512", "avx512_bf16", "amx_tile")
    (torch / "cpu.py").write_text("".join(f"def _is_{p}_supported(): return True\n" for p in probes))
    script = f"import torch.cpu as c; print([getattr(c, '_is_' + p + '_supported')() for p in {probes!r}])"
    env = {"PDCLIENT_EMULATED_CPU_ISA": "avx512", "PYTHONPATH": f"{_cpu_isa.SITE}:{tmp_path}"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[True, False, False]"  # AVX-512 kept, its bf16 and AMX gone
