"""Run the server_patch tier: pytest under the vLLM server venv, once per vLLM version.

    python tests/server_patch/run.py [--no-live] [--versions 0.20.2,0.26.0,0.32.0] [pytest args]

For each version a separate pytest process runs the server venv's Python with that
version's vLLM: the installed 0.32.0, or 0.20.2 / 0.26.0 unpacked in front of it (see
_vllm_src.py). Live tests (a real 0.32 server) run in the 0.32.0 pass. Exits non-zero if
any pass fails. Plain stdlib: run it from any Python that can import this checkout.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE)]

from _vllm_src import INSTALLED, UNPACKED, vllm_src  # noqa: E402

from pdclient.local import model_dir, server_python  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--versions", default=",".join((*UNPACKED, INSTALLED)))
    parser.add_argument("--no-live", action="store_true", help="skip the tests that start a real server")
    args, pytest_args = parser.parse_known_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    python = str(server_python())  # also reinstalls server_patch/ into the venv if it changed
    model = str(model_dir())
    results = {}
    for version in args.versions.split(","):
        src = vllm_src(version, python)
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(src) if src else "", str(REPO / "server_patch")) if p)
        env.update(PDCLIENT_TEST_VLLM=version, PDCLIENT_TEST_MODEL_DIR=model)
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1")
        env.pop("PDCLIENT_REUSE_SECRET", None)
        env.pop("PDCLIENT_REUSE_VERIFY_RATE", None)
        if src:
            env["PDCLIENT_TEST_VLLM_SRC"] = str(src)
        cmd = [python, "-m", "pytest", "-c", str(HERE / "pytest.ini"), str(HERE), "-q", "-rs"]
        if args.no_live or src:  # old versions: their CPU torch does not install here, so no server can run
            cmd += ["-m", "not live"]
        print(f"\n=== server_patch tests on vLLM {version} ===", flush=True)
        start = time.monotonic()
        # cwd = repo root, never server_patch/ (a same-named folder would shadow the plugin).
        code = subprocess.run([*cmd, *pytest_args], cwd=REPO, env=env).returncode
        results[version] = (code, time.monotonic() - start)
    print("\n=== server_patch summary ===")
    for version, (code, seconds) in results.items():
        print(f"vLLM {version}: {'passed' if code == 0 else f'FAILED (exit {code})'} in {seconds:.0f} s")
    return 0 if all(code == 0 for code, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
