"""The real pair as the framework and example tests use it: URLs, clients, environment.

The pair itself is tests/pair/conftest.py's session fixture ``pd`` (one per test process,
shared by every test of tests/pair; ``PDCLIENT_E2E_PAIR`` attaches to a running one). Tool calls need
the servers started with ``--enable-auto-tool-choice --tool-call-parser hermes`` (vLLM 0.32
answers 400 to any ``tools`` request otherwise), which that fixture does; ``supports_tools``
probes whether an attached pair has them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import httpx

from pdclient import AsyncPDChatClient, PDChatClient
from pdclient.local import PDServers

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

    @classmethod
    def of(cls, pd: PDServers) -> Pair:
        return cls(pd.prefill_url, pd.decode_url, pd.model)

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
