"""carpool's imports, read from the source with `ast` (nothing is imported):

- no cycles: any module can be imported first;
- one-way layers: core <- model <- engine <- harness <- {bench, sim} <- cli. Here every import
  counts, those inside functions too: a lazy import is a dependency all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

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


def imported(name: str, source: str, modules: dict[str, Path] | set[str], everywhere: bool,
             is_package: bool = False) -> set[str]:
    """The carpool modules `name` (whose text is `source`) imports: at module level (the body,
    its `if`/`try` blocks, not `if TYPE_CHECKING:`), or anywhere in the file with `everywhere`.
    `from package import module` counts as the module; a name from a package's __init__ as the
    package."""
    tree = ast.parse(source)
    package = name if is_package else name.rpartition(".")[0]

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
    return {name: imported(name, path.read_text(), modules, everywhere, path.name == "__init__.py")
            for name, path in modules.items()}


# Importer layer -> layers it must not import. A layer is carpool's first-level package or module
# (`carpool.core.scheduler` is in "core", `carpool.engine` is "engine").
FORBIDDEN = {
    "core": ("model", "engine", "harness", "bench", "sim", "server", "cli"),
    "model": ("engine", "harness", "bench", "sim", "server", "cli"),
    "engine": ("harness", "bench", "sim", "server", "cli"),
    "harness": ("bench", "sim", "server", "cli"),
    "bench": ("sim", "cli"),
    "sim": ("bench", "cli"),
}
TOOLS = ("bench", "sim")  # only these and the command line may import the benchmarks or the simulator


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_reader_sees_lazy_relative_and_package_imports():
    source = ("import os\nfrom carpool.core import step_cost\n"
              "def f():\n    from carpool.sim.run import run_simulate\n"
              "from . import plots\nfrom ..engine import LLMEngine\n")
    modules = {"carpool.core.step_cost", "carpool.sim.run", "carpool.bench.plots", "carpool.engine"}
    assert imported("carpool.bench.serving", source, modules, everywhere=True) == modules
    assert imported("carpool.bench.serving", source, modules, everywhere=False) == modules - {"carpool.sim.run"}
    assert imported("carpool.harness", "from . import x", {"carpool.harness.x"}, True, is_package=True) == {
        "carpool.harness.x"}
    graph = import_graph(everywhere=True)  # the real tree: the engine's own imports, lazy ones too
    assert "carpool.core.scheduler" in graph["carpool.engine"]
    assert "carpool.core.cost_profile" in graph["carpool.engine"]  # inside _step_cost_args


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


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_layers_import_only_downward(importer):
    bad = sorted(f"{module} imports {target}" for module, targets in import_graph(everywhere=True).items()
                 if layer(module) == importer for target in targets if layer(target) in FORBIDDEN[importer])
    assert not bad, "\n".join(bad)


def test_only_the_command_line_imports_benchmarks_and_the_simulator():
    bad = sorted(f"{module} imports {target}" for module, targets in import_graph(everywhere=True).items()
                 if layer(module) not in (*TOOLS, "cli") for target in targets if layer(target) in TOOLS)
    assert not bad, "\n".join(bad)
