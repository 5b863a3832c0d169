"""The check each backport makes before it wraps vLLM's methods: are they still there?"""

from __future__ import annotations

from collections.abc import Iterable


def missing(seams: Iterable[tuple[type, tuple[str, ...]]]) -> list[str]:
    """The ``Class.method`` names among ``seams`` that are not callable: vLLM changed them,
    and a backport that wrapped the rest would run half-installed."""
    return [
        f"{cls.__name__}.{name}" for cls, names in seams for name in names if not callable(getattr(cls, name, None))
    ]


def skipped(names: list[str]) -> str:
    return f"skipped (seam changed: {', '.join(names)} missing)"
