"""How a caller reaches a pair's servers, for ``LocalPD`` and the servers the environment names
(``PDServers``) alike: the first URLs, and the clients over every server."""

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


class PairAccess:
    """Mixed into what names a pair's servers (``prefill_urls``, ``decode_urls``)."""

    @property
    def prefill_url(self: _Servers) -> str:
        """The first prefill URL (pass ``prefill_urls`` to a client to use them all)."""
        return self.prefill_urls[0]

    @property
    def decode_url(self: _Servers) -> str:
        """The first decode URL (pass ``decode_urls`` to a client to use them all)."""
        return self.decode_urls[0]

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
