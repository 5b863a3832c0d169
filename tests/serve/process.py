"""Processes the proxy tests run (tests/serve, tests/pair): a real `python -m pdclient serve`,
and the npm openai package on Node.js (installed once per lockfile into the cache); and
Prometheus text parsed as samples."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

import pytest
from prometheus_client.parser import text_string_to_metric_families

STARTED = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


class ServeProcess:
    """`python -m pdclient serve ... --port 0`, its stderr and stdout collected, its port read
    from its stderr; ``env`` is added to this process's environment."""

    def __init__(self, *args: str, workers: int = 1, env: dict[str, str] | None = None) -> None:
        environ = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        command = [sys.executable, "-m", "pdclient", "serve", "--port", "0", "--workers", str(workers), *args]
        self.proc = subprocess.Popen(
            command, stderr=subprocess.PIPE, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True, env=environ
        )
        self.lines: list[str] = []
        """Its stderr (the logs), line by line."""
        self.out_lines: list[str] = []
        """Its stdout, line by line."""
        self._reader = threading.Thread(target=self._read, args=(self.proc.stderr, self.lines), daemon=True)
        self._reader.start()
        self._out_reader = threading.Thread(target=self._read, args=(self.proc.stdout, self.out_lines), daemon=True)
        self._out_reader.start()
        deadline = time.monotonic() + 60
        self.port = 0
        while time.monotonic() < deadline and self.proc.poll() is None:
            found = [m for line in list(self.lines) if (m := STARTED.search(line))]
            started = sum("Application startup complete" in line for line in list(self.lines))
            if found and started >= workers:
                self.port = int(found[0].group(1))
                break
            time.sleep(0.05)
        assert self.port, f"pdclient serve did not start: {self.stderr()}"
        self.url = f"http://127.0.0.1:{self.port}"

    @staticmethod
    def _read(stream: IO[str] | None, lines: list[str]) -> None:
        assert stream is not None
        for line in stream:
            lines.append(line.rstrip("\n"))

    def stderr(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        self._out_reader.join(5)


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text parsed by prometheus_client's parser: (sample name, sorted labels) -> value."""
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


NODE_PROJECT = Path(__file__).parent / "node"
NODE_FILES = ("package.json", "package-lock.json")
MIN_NODE = 18  # openai 6.x; 7.x needs 22


def cache_dir() -> Path:
    root = os.environ.get("PDCLIENT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdclient"
    )
    return Path(root)


def node_modules() -> tuple[str, Path]:
    """The node binary and the node_modules holding the locked openai package (installed once)."""
    node, npm = shutil.which("node"), shutil.which("npm")
    if node is None or npm is None:
        pytest.skip("Node.js and npm are not installed (apt-get install nodejs npm): the npm openai test needs them")
    version = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout.strip()
    if int(version.lstrip("v").split(".")[0]) < MIN_NODE:
        pytest.skip(f"Node.js {version} is older than {MIN_NODE}, which the npm openai package needs")
    digest = hashlib.sha256(b"".join((NODE_PROJECT / f).read_bytes() for f in NODE_FILES)).hexdigest()[:12]
    target = cache_dir() / "node" / f"openai-{digest}"
    if not (target / ".ready").exists():
        target.mkdir(parents=True, exist_ok=True)
        with open(target.parent / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (target / ".ready").exists():
                for name in NODE_FILES:
                    shutil.copy(NODE_PROJECT / name, target / name)
                subprocess.run(
                    [npm, "ci", "--no-audit", "--no-fund", "--loglevel=error"],
                    cwd=target,
                    check=True,
                    timeout=600,
                )
                (target / ".ready").touch()
    return node, target / "node_modules"
