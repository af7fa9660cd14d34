"""carpool's modules import one another without cycles: data and control flow one way, and any
module can be imported first. Read from the source with `ast`; nothing is imported."""

from __future__ import annotations

import ast
from pathlib import Path

import carpool

ROOT = Path(carpool.__file__).parent


def module_names() -> dict[str, Path]:
    names = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imported(name: str, path: Path, modules: dict[str, Path], everywhere: bool) -> set[str]:
    """The carpool modules `name` imports: at module level (the body, its `if`/`try` blocks, not
    `if TYPE_CHECKING:`), or anywhere in the file with `everywhere`. `from package import module`
    counts as the module; a name from a package's __init__ as the package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]

    def statements(body: list[ast.stmt]):
        for node in body:
            yield node
            if isinstance(node, ast.If):
                if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                    yield from statements(node.body + node.orelse)
            elif isinstance(node, ast.Try):
                yield from statements(node.body + node.orelse + node.finalbody
                                      + [s for h in node.handlers for s in h.body])
            elif everywhere and not isinstance(node, ast.If):
                yield from statements([c for c in ast.iter_child_nodes(node) if isinstance(c, ast.stmt)])

    found: set[str] = set()
    for node in statements(tree.body):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
    result = set()
    for target in found:
        while target and target not in modules:  # a name inside a module: that module
            target = target.rpartition(".")[0]
        if target and target != name:
            result.add(target)
    return result


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def import_graph(everywhere: bool = False) -> dict[str, set[str]]:
    modules = module_names()
    return {name: imported(name, path, modules, everywhere) for name, path in modules.items()}


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_at_module_level():
    graph = import_graph()
    assert "carpool.server.engine_client" in graph["carpool.server.app"]  # the reader sees imports
    assert cycles(graph) == []


def test_no_import_cycle_in_the_server_even_inside_functions():
    """The server imports some modules late (so that `carpool --help` stays light); counting
    those too, its modules still form no circle."""
    graph = import_graph(everywhere=True)
    server = {name: {m for m in deps if m.startswith("carpool.server")}
              for name, deps in graph.items() if name.startswith("carpool.server")}
    assert cycles(server) == []
