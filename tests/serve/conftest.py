"""The proxy against loopback stubs: a real uvicorn server in a thread, a real stub of vLLM."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("starlette", reason="pdclient[serve] is not installed")
pytest.importorskip("uvicorn", reason="pdclient[serve] is not installed")

from pdclient.serve import ServeConfig, create_app
from pdclient.serve._proxy import Proxy
from pdclient.serve._run import server_config
from pdclient.serve._server import Server
from tests.serve.process import ServeProcess, metric_samples
from tests.stubserver import StubServer

__all__ = ["ServeProcess", "metric_samples"]  # imported by the tests from here

PROMPT_TOKENS = 96
MESSAGES: Any = [{"role": "user", "content": "Say hello."}]
ANSWER = "Hello from the decode stub"


@dataclass
class RunningProxy:
    url: str
    """``http://127.0.0.1:PORT`` (the OpenAI base URL is ``url + "/v1"``)."""
    proxy: Proxy

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


def started_in_thread(server: Server) -> tuple[threading.Thread, int]:
    """``server`` run in a daemon thread, once it listens: the thread and its port."""
    thread = threading.Thread(target=server.run, name="pdclient-serve-test", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.01)
    return thread, server.servers[0].sockets[0].getsockname()[1]


@contextlib.contextmanager
def running_proxy(
    config: ServeConfig, *, server_options: dict[str, Any] | None = None, **app_options: Any
) -> Iterator[RunningProxy]:
    """``create_app(config)`` served by uvicorn as ``pdclient serve`` serves it (its limits on
    clients included), on an ephemeral loopback port, in a thread."""
    app = create_app(config, **app_options)
    options = {"host": "127.0.0.1", "port": 0, "log_config": None, "timeout_graceful_shutdown": 2}
    server = Server(server_config(config, app, **{**options, **(server_options or {})}))
    thread, port = started_in_thread(server)
    try:
        yield RunningProxy(f"http://127.0.0.1:{port}", app.state.proxy)
    finally:
        server.should_exit = True
        thread.join(10)


def config_for(
    prefill: str, decode: str | list[str] | None = None, *, observers: Any = (), **settings: Any
) -> ServeConfig:
    """A config from flat settings (as flags and files spell them), plus observers of the test's own."""
    decode = decode or prefill
    config = ServeConfig.from_mapping(
        {"prefill": [prefill], "decode": [decode] if isinstance(decode, str) else decode, **settings}
    )
    if observers:
        config = dataclasses.replace(config, options=config.options.replace(observers=observers))
    return config


@pytest.fixture(scope="module")
def stub_server() -> Iterator[StubServer]:
    with StubServer(prompt_tokens=PROMPT_TOKENS) as stub:
        yield stub


@pytest.fixture
def stub(stub_server: StubServer) -> StubServer:
    stub_server.clear()
    return stub_server


@pytest.fixture
def proxy(stub: StubServer) -> Iterator[RunningProxy]:
    with running_proxy(config_for(stub.url)) as running:
        yield running
