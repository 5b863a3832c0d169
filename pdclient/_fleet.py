"""The fleet a client talks to: its prefill and decode pools, shared by the client's copies.

Made from the options that shape routing (the URLs, the routing policy, the breaker
settings); a copy of a client whose options differ only elsewhere shares its fleet, so
endpoint health and in-flight counts are one view per fleet, as openai copies share
their connection pool.
"""

from __future__ import annotations

from ._endpoints import EndpointPool
from ._options import PDOptions
from ._routing import make_policy

_FLEET_FIELDS = ("prefill_base_url", "decode_base_url", "routing", "breaker")


class Fleet:
    def __init__(self, options: PDOptions) -> None:
        self._key = tuple(getattr(options, name) for name in _FLEET_FIELDS)
        # Each pool gets its own policy object: policies may keep state (round robin's turn).
        self.prefill = EndpointPool("prefill", options.prefill_urls, make_policy(options.routing), options.breaker)
        self.decode = EndpointPool("decode", options.decode_urls, make_policy(options.routing), options.breaker)

    def serves(self, options: PDOptions) -> bool:
        """Whether ``options`` route exactly as this fleet does."""
        return all(
            a is b or a == b for a, b in zip(self._key, (getattr(options, n) for n in _FLEET_FIELDS), strict=True)
        )

    @property
    def pools(self) -> tuple[EndpointPool, EndpointPool]:
        return self.prefill, self.decode

    def close(self) -> None:
        """Stop what the fleet runs in the background (nothing yet)."""
