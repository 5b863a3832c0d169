"""``handoff.Call`` holds one call's state, not every decision about it: its size and how
much other code leans on it are counted by ``tools/call_hub.py`` and held under bounds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400
MAX_METHODS = 32
MAX_USED = 48
"""Its members other files name (a call's state read and its transitions asked for)."""
MAX_WRITTEN = 1
"""Its fields assigned from outside its methods: module functions leave its state to it."""


def test_call_stays_within_its_bounds() -> None:
    spec = importlib.util.spec_from_file_location("call_hub", ROOT / "tools" / "call_hub.py")
    assert spec is not None and spec.loader is not None
    tool = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = tool  # its dataclass looks its module up
    spec.loader.exec_module(tool)
    hub = tool.measure(ROOT / "pdclient")
    assert hub.used, "the counter finds the call's users"
    assert hub.lines <= MAX_LINES, hub.lines
    assert len(hub.methods) <= MAX_METHODS, sorted(hub.methods)
    assert len(hub.used) <= MAX_USED, sorted(hub.used)
    assert len(hub.written) <= MAX_WRITTEN, sorted(hub.written)
