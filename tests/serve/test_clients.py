"""Other clients through the proxy: the npm openai package on Node.js, and `curl -N`.

Node comes from the machine (/usr/bin/node, or Debian's nodejs and npm packages); without
it the test is skipped, with the reason. The npm package is installed once per lockfile
(tests/serve/node/package-lock.json) into the cache, outside the checkout:
``${PDCLIENT_CACHE_DIR:-~/.cache/pdclient}/node/openai-<hash>``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading

import pytest

from tests.serve.process import NODE_PROJECT, node_modules
from tests.stubserver import Fault, StubServer

from .conftest import ANSWER, RunningProxy


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
