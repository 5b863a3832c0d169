"""One real prefill+decode pair for the framework and example tests, shared with tests/e2e.

A pair costs ~7 GB and ~1 min, so this never starts a second one in a test process:

1. ``PDCLIENT_E2E_PAIR=prefill_url,decode_url`` attaches to a running pair (as tests/e2e does);
2. else a ``LocalPD`` already running in this process (tests/e2e's session pair, which
   pytest sets up first: tests/e2e sorts before tests/frameworks and tests/test_examples.py)
   is reused;
3. else one is started here, with vLLM's tool calling switched on, and stopped at exit.

Tool calls need the servers started with ``--enable-auto-tool-choice --tool-call-parser
hermes`` (vLLM 0.32 answers 400 to any ``tools`` request otherwise); ``supports_tools``
probes whether the pair in use has them.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

import httpx

from pdclient import AsyncPDChatClient, PDChatClient

TOOL_SERVER_ARGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@dataclass(frozen=True)
class Pair:
    prefill_url: str
    decode_url: str
    model: str
    owner: Any = None
    """The LocalPD behind it, if this process runs it."""

    def client(self, **kwargs: Any) -> PDChatClient:
        kwargs.setdefault("api_key", "EMPTY")
        return PDChatClient(prefill_base_url=self.prefill_url, decode_base_url=self.decode_url, **kwargs)

    def async_client(self, **kwargs: Any) -> AsyncPDChatClient:
        kwargs.setdefault("api_key", "EMPTY")
        return AsyncPDChatClient(prefill_base_url=self.prefill_url, decode_base_url=self.decode_url, **kwargs)

    def env(self) -> dict[str, str]:
        """Environment that points pdclient (and the examples) at this pair."""
        return {
            "PDCLIENT_PREFILL_BASE_URL": self.prefill_url,
            "PDCLIENT_DECODE_BASE_URL": self.decode_url,
            "PDCLIENT_MODEL": self.model,
        }

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the decode server accepts a tools request (started with a tool-call parser)."""
        body = {
            "model": self.model,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [WEATHER_TOOL],
            "max_tokens": 1,
        }
        response = httpx.post(f"{self.decode_url}/chat/completions", json=body, timeout=120)
        return response.status_code == 200


@functools.cache
def shared_pair() -> Pair:
    attach = os.environ.get("PDCLIENT_E2E_PAIR")
    if attach:
        prefill_url, decode_url = (u.strip().rstrip("/") for u in attach.split(","))
        models = httpx.get(f"{decode_url}/models", timeout=30).json()["data"]
        return Pair(prefill_url, decode_url, os.environ.get("PDCLIENT_MODEL") or models[0]["id"])
    from pdclient.local import LocalPD
    from pdclient.local import _pair as local_pair

    for running in list(local_pair._live):
        if running.prefill is not None:
            return Pair(running.prefill_url, running.decode_url, running.model, running)
    # Stopped at interpreter exit by LocalPD's own atexit hook, like every pair it started.
    pd = LocalPD(extra_server_args=TOOL_SERVER_ARGS).start()
    return Pair(pd.prefill_url, pd.decode_url, pd.model, pd)
