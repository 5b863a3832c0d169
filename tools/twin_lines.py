"""Counts pdclient's twin lines: sync/async code written twice.

    python tools/twin_lines.py [ROOT]      (ROOT: the package directory, default pdclient)

A twin pair is two classes of one module named ``X`` and ``AsyncX`` (or ``SyncX`` and
``AsyncX``); the module-level ``_SYNC`` / ``_ASYNC`` step tables count with them. Their
code lines are counted without blank lines, comments and docstrings. Prints one line per
pair and the total.
"""

from __future__ import annotations

import ast
import io
import sys
import tokenize
from pathlib import Path

TABLES = ("_SYNC", "_ASYNC")


def _code_lines(source: str, tree: ast.Module) -> set[int]:
    """The lines holding a token other than a comment, a docstring or layout."""
    docstrings: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            docstrings.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    layout = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    lines: set[int] = set()
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type not in layout:
            lines.update(range(token.start[0], token.end[0] + 1))
    return lines - docstrings


def _span(node: ast.AST) -> range:
    decorators = getattr(node, "decorator_list", [])
    first = min([node.lineno] + [decorator.lineno for decorator in decorators])  # type: ignore[attr-defined]
    return range(first, node.end_lineno + 1)  # type: ignore[attr-defined]


def twins(path: Path) -> list[tuple[str, int]]:
    """The twin pairs of one module (and its step tables), each with its code lines."""
    source = path.read_text()
    tree = ast.parse(source)
    code = _code_lines(source, tree)
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    found: list[tuple[str, int]] = []
    for name, node in classes.items():
        if not name.startswith("Async"):
            continue
        stem = name.removeprefix("Async")
        sync = classes.get(stem) or classes.get("Sync" + stem)
        if sync is not None:
            lines = len(code.intersection(_span(sync))) + len(code.intersection(_span(node)))
            found.append((f"{sync.name} / {name}", lines))
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Name) and target.id in TABLES:
                found.append((target.id, len(code.intersection(_span(node)))))
    return found


def main(root: Path) -> int:
    total = 0
    for path in sorted(root.rglob("*.py")):
        for name, lines in twins(path):
            print(f"{lines:5d}  {path}  {name}")
            total += lines
    print(f"{total:5d}  twin lines in all")
    return total


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "pdclient"))
