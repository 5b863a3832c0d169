"""The options one call runs under, resolved once when it is planned: its per-call options
(``extra_body={"pdclient": {...}}``, ``wire.CallOptions``) over its client's ``PDOptions``.
The decisions read these values, never the two sources again."""

from __future__ import annotations

from dataclasses import dataclass

from .._options import PDOptions
from ..wire import CallOptions


@dataclass(frozen=True, slots=True)
class EffectiveOptions:
    on_prefill_failure: str
    dispatch: str
    remote_prefill: str
    max_decode_migrations: int

    @classmethod
    def resolve(cls, call: CallOptions, client: PDOptions) -> EffectiveOptions:
        migrations = call.max_decode_migrations
        return cls(
            on_prefill_failure=call.on_prefill_failure or client.on_prefill_failure,
            dispatch=call.dispatch or client.dispatch,
            remote_prefill=call.remote_prefill or client.remote_prefill,
            max_decode_migrations=client.max_decode_migrations if migrations is None else migrations,
        )


__all__ = ["EffectiveOptions"]
