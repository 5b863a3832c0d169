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
import tempfile
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
    passes: list[tuple[str, list[str], dict[str, str], bool]] = []
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
        live = not (args.no_live or src)  # old versions: their CPU torch does not install here, so no server can run
        if not live:
            cmd += ["-m", "not live"]
        passes.append((version, [*cmd, *pytest_args], env, live))

    results: dict[str, tuple[int, float]] = {}
    # The passes that start no server run side by side (each is one busy Python process: on
    # two cores the two old versions take ~1.5 min together, not ~3 one after the other),
    # their output printed whole as each ends; a pass with a real server runs alone after.
    # cwd = repo root, never server_patch/ (a same-named folder would shadow the plugin).
    with tempfile.TemporaryDirectory() as tmp:
        running = []
        for version, cmd, env, live in passes:
            if not live:
                output = open(Path(tmp) / f"{version}.log", "w+b")  # noqa: SIM115
                started = time.monotonic()
                process = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT)
                running.append((version, process, output, started))
        for version, process, output, started in running:
            code = process.wait()
            results[version] = (code, time.monotonic() - started)
            print(f"\n=== server_patch tests on vLLM {version} ===", flush=True)
            output.seek(0)
            sys.stdout.buffer.write(output.read())
            sys.stdout.flush()
            output.close()
    for version, cmd, env, live in passes:
        if live:
            print(f"\n=== server_patch tests on vLLM {version} ===", flush=True)
            started = time.monotonic()
            code = subprocess.run(cmd, cwd=REPO, env=env).returncode
            results[version] = (code, time.monotonic() - started)
    print("\n=== server_patch summary ===")
    for version, *_ in passes:
        code, seconds = results[version]
        print(f"vLLM {version}: {'passed' if code == 0 else f'FAILED (exit {code})'} in {seconds:.0f} s")
    return 0 if all(code == 0 for code, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
