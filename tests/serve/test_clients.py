"""Other clients through the proxy: the npm openai package on Node.js, and `curl -N`.

Node comes from the machine (/usr/bin/node, or Debian's nodejs and npm packages); without
it the test is skipped, with the reason. The npm package is installed once per lockfile
(tests/serve/node/package-lock.json) into the cache, outside the checkout:
``${PDCLIENT_CACHE_DIR:-~/.cache/pdclient}/node/openai-<hash>``.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import threading
from pathlib import Path

import pytest

from tests.stubserver import Fault, StubServer

from .conftest import ANSWER, RunningProxy

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


def test_npm_openai_streams_a_chat_through_the_proxy(proxy: RunningProxy, stub: StubServer) -> None:
    node, modules = node_modules()
    gate = threading.Semaphore(0)
    stub.inject(Fault(event_gate=gate), leg="decode")
    command = [node, str(NODE_PROJECT / "stream_chat.cjs"), str(modules)]
    env = {**os.environ, "PROXY_BASE_URL": proxy.base_url}
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None and process.stderr is not None
        lines = []
        for line in process.stdout:
            lines.append(json.loads(line))
            gate.release()  # the stub sends its next event only once Node has printed this chunk
        assert process.wait(30) == 0, process.stderr.read()
    assert lines[-1] == {"done": True, "text": ANSWER}
    assert len(lines) == 7  # six chunks (the stub's events before [DONE]), each seen before the next left
    assert stub.legs("decode")[0].forwarded_ids == stub.prompt_tokens


def test_curl_streams_chunk_by_chunk(proxy: RunningProxy, stub: StubServer) -> None:
    curl = shutil.which("curl")
    if curl is None:
        pytest.skip("curl is not installed (apt-get install curl)")
    gate = threading.Semaphore(0)
    stub.inject(Fault(event_gate=gate), leg="decode")
    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True})
    command = [curl, "-N", "-sS", "--max-time", "30", "-H", "content-type: application/json", "--data-binary", "@-"]
    with subprocess.Popen(
        [*command, proxy.base_url + "/chat/completions"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as process:
        assert process.stdin is not None and process.stdout is not None
        process.stdin.write(body)
        process.stdin.close()
        events = []
        for line in process.stdout:
            if line.startswith("data: "):
                events.append(line.strip())
                gate.release()  # the stub sends its next event only once curl has printed this one
        assert process.wait(10) == 0
    assert events[-1] == "data: [DONE]" and len(events) == 7
    text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == ANSWER
