"""Durations in settings: the one check every setting that is a number of seconds goes through.

A bound written as ``value < 0`` lets NaN through (NaN compares false with everything), and
a NaN or infinite duration is no duration: a grace period of NaN seconds ends the drain at
once, an infinite probe interval never probes again. "No bound" is spelled ``None`` where a
setting offers it, never ``inf``.
"""

from __future__ import annotations

import math

from ._errors import PDConfigError


def check_seconds(name: str, value: object, *, zero: bool = False, none: bool = False) -> None:
    """``value`` must be a finite number of seconds, above 0 (at least 0 with ``zero``; or
    None with ``none``): else a ``PDConfigError`` naming ``name``."""
    if value is None and none:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value < 0
        or (value == 0 and not zero)
    ):
        bound = ">= 0" if zero else "> 0"
        alternative = " or None (no bound)" if none else ""
        raise PDConfigError(f"{name} must be a finite number of seconds {bound}{alternative}, got {value!r}")
