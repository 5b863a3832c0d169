"""Measures how much of a hub ``handoff.Call`` is: its size, and how other code leans on it.

    python tools/call_hub.py [ROOT]      (ROOT: the package directory, default pdclient)

Prints the class's lines (its whole span), its methods (properties included), its
attributes (the names its methods assign on ``self``), the members other files read or
write and how many files, and the fields written from outside the class (``call.X = ...``
anywhere but in its own methods; ``call.X.Y = ...`` counted apart: a field of something
the call holds, its record's for one). Other code names a call ``call``, ``self.call`` or
``self._call``; only the names of ``Call``'s own members count, so a ``call`` that is
something else passes unseen unless it shares a member's name.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass, field
from pathlib import Path

MODULE = Path("handoff") / "_call.py"
CLASS = "Call"
RECEIVERS = {"call", "self.call", "self._call"}


@dataclass
class Hub:
    lines: int = 0
    methods: set[str] = field(default_factory=set)
    attributes: set[str] = field(default_factory=set)
    used: dict[str, set[str]] = field(default_factory=dict)
    """Member -> the other files that use it."""
    written: set[str] = field(default_factory=set)
    """``call.X = ...`` outside the class's methods, as ``file: X``."""
    written_nested: set[str] = field(default_factory=set)
    """``call.X.Y = ...`` outside the class's methods, as ``file: X.Y``."""

    @property
    def members(self) -> set[str]:
        return self.methods | self.attributes


def _receiver(node: ast.expr) -> bool:
    return ast.unparse(node) in RECEIVERS


def _the_class(tree: ast.Module) -> ast.ClassDef:
    return next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == CLASS)


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        flat: list[ast.expr] = []
        for target in node.targets:
            flat.extend(target.elts if isinstance(target, ast.Tuple) else [target])
        return flat
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    return []


def _writes(nodes: list[ast.AST], hub: Hub, where: str) -> None:
    for node in nodes:
        for target in _targets(node):
            if not isinstance(target, ast.Attribute):
                continue
            if _receiver(target.value) and target.attr in hub.members:
                hub.written.add(f"{where}: {target.attr}")
            inner = target.value
            if isinstance(inner, ast.Attribute) and _receiver(inner.value) and inner.attr in hub.members:
                hub.written_nested.add(f"{where}: {inner.attr}.{target.attr}")


def measure(root: Path) -> Hub:
    hub = Hub()
    module = root / MODULE
    tree = ast.parse(module.read_text())
    cls = _the_class(tree)
    hub.lines = (cls.end_lineno or cls.lineno) - cls.lineno + 1
    methods = [node for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    hub.methods = {method.name for method in methods}
    for method in methods:
        for node in ast.walk(method):
            for target in _targets(node):
                if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                    hub.attributes.add(target.attr)
    inside = {id(node) for method in methods for node in ast.walk(method)}
    outside = [node for node in ast.walk(tree) if id(node) not in inside]
    _writes(outside, hub, str(MODULE))
    for path in sorted(root.rglob("*.py")):
        where = str(path.relative_to(root))
        if path == module:
            continue
        nodes = list(ast.walk(ast.parse(path.read_text())))
        for node in nodes:
            if isinstance(node, ast.Attribute) and _receiver(node.value) and node.attr in hub.members:
                hub.used.setdefault(node.attr, set()).add(where)
        _writes(nodes, hub, where)
    return hub


def main(root: Path) -> Hub:
    hub = measure(root)
    files = set().union(*hub.used.values()) if hub.used else set()
    print(f"{hub.lines:5d}  lines of {CLASS}")
    print(f"{len(hub.methods):5d}  methods")
    print(f"{len(hub.attributes):5d}  attributes")
    print(f"{len(hub.used):5d}  members used from {len(files)} other files")
    print(f"{len(hub.written):5d}  of its fields written from outside the class: {', '.join(sorted(hub.written))}")
    nested = ", ".join(sorted(hub.written_nested))
    print(f"{len(hub.written_nested):5d}  fields of what it holds written from outside: {nested}")
    return hub


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "pdclient"))
