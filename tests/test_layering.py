"""carpool's packages depend one way: core <- model <- engine <- harness <- {bench, sim} <- cli.

Read from the source with `ast`. Every import counts, those inside functions and under
TYPE_CHECKING too: a lazy import is a dependency all the same.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import carpool

PACKAGE = Path(carpool.__file__).parent

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
# Only these (and the command line) may import the benchmarks or the simulator.
TOOLS = ("bench", "sim")


def imports(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every carpool module (or name in one) that `source`, the text of `module`, imports."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from carpool import bench`
    return {m for m in found if m == "carpool" or m.startswith("carpool.")}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def import_graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        is_package = rel.name == "__init__"
        module = ".".join(rel.parts[:-1] if is_package else rel.parts)
        graph[module] = imports(path.read_text(), module, is_package)
    return graph


GRAPH = import_graph()


def test_the_reader_sees_lazy_relative_and_package_imports():
    source = ("import os\nfrom carpool.core import step_cost\n"
              "def f():\n    from carpool.sim.run import run_simulate\n"
              "from . import plots\nfrom ..engine import LLMEngine\n")
    assert imports(source, "carpool.bench.serving") == {
        "carpool.core", "carpool.core.step_cost", "carpool.sim.run", "carpool.sim.run.run_simulate",
        "carpool.bench", "carpool.bench.plots", "carpool.engine", "carpool.engine.LLMEngine"}
    assert imports("from . import x", "carpool.harness", is_package=True) == {"carpool.harness", "carpool.harness.x"}
    # The real tree is read: the engine's own imports are there, lazy ones included.
    assert "carpool.core.scheduler" in GRAPH["carpool.engine"]
    assert "carpool.core.cost_profile" in GRAPH["carpool.engine"]  # inside _step_cost_args
    assert "carpool.harness.metrics" in GRAPH["carpool.harness.drivers"]


@pytest.mark.parametrize("importer", sorted(FORBIDDEN))
def test_layers_import_only_downward(importer):
    bad = sorted(f"{module} imports {target}" for module, targets in GRAPH.items() if layer(module) == importer
                 for target in targets if layer(target) in FORBIDDEN[importer])
    assert not bad, "\n".join(bad)


def test_only_the_command_line_imports_benchmarks_and_the_simulator():
    bad = sorted(f"{module} imports {target}" for module, targets in GRAPH.items()
                 if layer(module) not in (*TOOLS, "cli")
                 for target in targets if layer(target) in TOOLS)
    assert not bad, "\n".join(bad)
