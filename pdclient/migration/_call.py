"""What a migration reads of the call it moves (``handoff.Call`` has it all).

Written here, not imported from ``handoff``: the handoff drives the migration, so the
migration names only the parts of a call it uses and the package keeps below the handoff.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import httpx

from ..fleet import Fleet
from ..pools import Endpoint
from ..routing import RouteRequest
from ..wire import Plan, PrefillResult


class MigrationOptions(Protocol):
    @property
    def max_decode_migrations(self) -> int: ...

    @property
    def migrate_non_streamed(self) -> bool: ...


class EffectiveMigrations(Protocol):
    """What a migration reads of the options one call runs under."""

    @property
    def max_decode_migrations(self) -> int: ...


class MigratingContext(Protocol):
    @property
    def options(self) -> MigrationOptions: ...

    @property
    def fleet(self) -> Fleet: ...


class MigratingLeg(Protocol):
    """The call's prefill or decode leg."""

    @property
    def endpoint(self) -> Endpoint | None: ...

    @property
    def url(self) -> str: ...

    def pick(self, route: RouteRequest, exclude: Sequence[Endpoint] = ()) -> str: ...

    def start(self, request: httpx.Request) -> httpx.Request: ...


class SignedRequests(Protocol):
    def signed(self, base: str, content: bytes, deadline: float | None = None) -> httpx.Request: ...


class MigratingCall(Protocol):
    @property
    def plan(self) -> Plan | None: ...

    @property
    def context(self) -> MigratingContext: ...

    @property
    def prefill_result(self) -> PrefillResult | None: ...

    @property
    def fallback_url(self) -> str | None: ...

    @property
    def prefill(self) -> MigratingLeg: ...

    @property
    def decode(self) -> MigratingLeg: ...

    @property
    def leg_request_id(self) -> str: ...

    @property
    def effective(self) -> EffectiveMigrations:
        """The options this call runs under (its per-call options over its client's)."""
        ...

    @property
    def deadline(self) -> float | None: ...

    @property
    def requests(self) -> SignedRequests: ...

    def route_for(self, leg: str) -> RouteRequest: ...
