"""The clients over a pair's every server: ``client()`` / ``async_client()`` of ``LocalPD`` and of
the servers named by the environment (``PDServers``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .._client import AsyncPDChatClient, PDChatClient


class _Servers(Protocol):
    @property
    def prefill_urls(self) -> Sequence[str]: ...

    @property
    def decode_urls(self) -> Sequence[str]: ...


class PairClients:
    """Mixed into what names a pair's servers (``prefill_urls``, ``decode_urls``)."""

    def client(self: _Servers, **kwargs: Any) -> PDChatClient:
        """A PDChatClient over every server; kwargs go to its constructor."""
        from .._client import PDChatClient

        kwargs.setdefault("api_key", "EMPTY")
        return PDChatClient(prefill_base_url=self.prefill_urls, decode_base_url=self.decode_urls, **kwargs)

    def async_client(self: _Servers, **kwargs: Any) -> AsyncPDChatClient:
        """An AsyncPDChatClient over every server; kwargs go to its constructor."""
        from .._client import AsyncPDChatClient

        kwargs.setdefault("api_key", "EMPTY")
        return AsyncPDChatClient(prefill_base_url=self.prefill_urls, decode_base_url=self.decode_urls, **kwargs)
