"""The sync and async drivers stay thin: the code written twice, once per I/O style, is
counted by ``tools/twin_lines.py`` and held under a bound."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BOUND = 260
"""Was 250: the async driver and stream gained the relay's ten lines (``transport._relay``), which
have no sync twin: a sync caller reads its own stream, and a chunk has nowhere to be pushed."""


def _twin_lines() -> list[tuple[str, int]]:
    spec = importlib.util.spec_from_file_location("twin_lines", ROOT / "tools" / "twin_lines.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    return [pair for path in sorted((ROOT / "pdclient").rglob("*.py")) for pair in tool.twins(path)]


def test_the_twin_lines_stay_within_their_bound() -> None:
    pairs = _twin_lines()
    assert pairs, "the counter finds the drivers' twins"
    assert sum(lines for _, lines in pairs) <= BOUND, pairs
