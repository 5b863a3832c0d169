"""The package's layout: no runtime import cycle among pdclient's modules, no cycle among its
packages even counting type-only imports, no package reaching into another's private
modules, a small top level.

The import graph is read from the source with ``ast``: every import a module runs,
function-local ones included (they run on the first call and can close a cycle then);
imports under ``if TYPE_CHECKING:`` are left out (they never run) unless asked for: a
type one package names from another is a dependency all the same. ``from P import n``
is an edge to ``P`` and, when ``n`` is a submodule, to ``P.n`` (``from . import _x`` in a
module of ``P`` is an edge to ``P._x`` only: ``P`` is already importing). The layers
themselves are the import-linter contract in pyproject.toml (``make lint``).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

import pdclient

PACKAGE = Path(pdclient.__file__).parent
MAX_TOP_LEVEL_MODULES = 12


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def runtime_imports(tree: ast.AST, *, type_checking: bool = False) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: anywhere, except in a TYPE_CHECKING block
    (unless ``type_checking``)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test) and not type_checking:
            yield from runtime_imports(ast.Module(body=node.orelse, type_ignores=[]))
        else:
            yield from runtime_imports(node, type_checking=type_checking)


def import_graph(*, type_checking: bool = False) -> dict[str, set[str]]:
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in runtime_imports(ast.parse(path.read_text(), str(path)), type_checking=type_checking):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join([*base, node.module] if node.module else base)
                else:
                    target = node.module or ""
                submodules = [f"{target}.{alias.name}" for alias in node.names]
                only_submodules = all(s in files for s in submodules)
                ancestor = name == target or name.startswith(target + ".")
                targets = submodules if only_submodules and ancestor else [target, *submodules]
            graph[name].update(t for t in targets if t in files and t != name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph[node]):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    """``pdclient.routing._policy`` -> ``pdclient.routing``; a top-level module is its own."""
    return ".".join(module.split(".")[:2])


def package_graph() -> dict[str, set[str]]:
    """Which package imports which, type-only imports counted."""
    graph: dict[str, set[str]] = {}
    for module, targets in import_graph(type_checking=True).items():
        package = package_of(module)
        graph.setdefault(package, set()).update(package_of(t) for t in targets if package_of(t) != package)
    return graph


def private_imports() -> list[str]:
    """Imports of a module private to another package (``pdclient.wire._bodies`` from outside
    ``pdclient.wire``): a package's ``__init__`` says what the others may use."""
    found = []
    for module, targets in import_graph(type_checking=True).items():
        for target in targets:
            owner, _, name = target.rpartition(".")
            private = name.startswith("_") and owner not in ("", "pdclient")
            if private and not (module == owner or module.startswith(owner + ".")):
                found.append(f"{module} -> {target}")
    return sorted(found)


def test_no_package_cycle_counting_type_only_imports() -> None:
    graph = package_graph()
    assert "pdclient.routing" in graph and "pdclient.handoff" in graph
    assert cycles(graph) == []


def test_no_package_imports_another_packages_private_module() -> None:
    assert private_imports() == []


def test_no_runtime_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 20, "the graph should hold every module"
    assert cycles(graph) == []


def test_the_graph_sees_function_local_imports_and_skips_type_checking_ones() -> None:
    graph = import_graph()
    assert "pdclient.serve._app" in graph["pdclient.serve._run"], "run() imports the app inside the function"
    assert "pdclient._client" not in graph["pdclient.cli._common"], "TYPE_CHECKING only"
    assert "pdclient._client" in import_graph(type_checking=True)["pdclient.cli._common"]


CONCERNS = {
    "conversations/_settings.py": {"ConversationSettings"},
    "conversations/_memory.py": {"ConversationMemory"},
    "conversations/_digests.py": {"messages_digest", "rendered_chars"},
    "conversations/_decision.py": {"Estimate", "decide_remote_prefill"},
    "conversations/_answer.py": {"AnswerCollector"},
    "costs/_line.py": {"CostLine", "Line"},
    "costs/_model.py": {"CostModel", "RouteCosts"},
    "costs/_priors.py": {"CostPriors"},
    "costs/_dispatch_choice.py": {"DispatchChooser", "DispatchChoice", "DispatchReason"},
    "serve/_app.py": {"create_app", "ProxyApp"},
    "serve/_proxy.py": {"Proxy"},
    "serve/_paths.py": {"upstream_path", "own_location"},
    "serve/_readiness.py": {"readiness", "first_probes"},
    "serve/_signals.py": {"on_shutdown_signal"},
    "serve/_summary.py": {"startup_summary"},
    "migration/_arming.py": {"arm", "static_refusal"},
    "migration/_call_migration.py": {"CallMigration", "CannotMove"},
    "migration/_tracker.py": {"Tracker"},
    "migration/_splice.py": {"Splice"},
    "migration/_continuation.py": {"Continuation", "Route", "continuation_route", "REMOTE_PREFILL_MIN_TOKENS"},
    "migration/_assembler.py": {"Assembler", "CannotAssemble"},
    "wire/_plan.py": {"Plan", "plan_call", "Fields"},
    "wire/_forwarded.py": {"check_forwarded_body", "UploadScan"},
    "wire/_prefill.py": {"prefill_body", "read_prefill"},
    "wire/_bodies.py": {"decode_body", "release_body"},
}


def defined_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return names


@pytest.mark.parametrize("module", sorted(CONCERNS))
def test_each_concern_has_a_module_of_its_own(module: str) -> None:
    path = PACKAGE / module
    assert path.exists(), module
    assert CONCERNS[module] <= defined_names(path)


def test_the_top_level_holds_the_public_types_and_entry_points() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= MAX_TOP_LEVEL_MODULES, top


if __name__ == "__main__":  # python tests/unit/test_layout.py: the cycles, with their edges
    for line in private_imports():
        print("private:", line)
    for component in cycles(package_graph()):
        print("packages:", " <-> ".join(component))
    graph = import_graph()
    for component in cycles(graph):
        print(" <-> ".join(component))
        for module in component:
            print("   ", module, "->", ", ".join(sorted(graph[module] & set(component))))
