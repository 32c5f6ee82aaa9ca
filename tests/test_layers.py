"""The layer order of docs/architecture.md, checked: every import of the project's code — at a
module's top, inside a function (lazy), under ``TYPE_CHECKING`` or through
``importlib.import_module("...")`` with a literal name — goes down the table :data:`LAYERS` or
stays in its own package; packages import each other without a cycle; and the benchmarks
reach a trainer (or any package they measure) only through the names its ``__init__``
exports, what a user's script could call.

The check reads the sources with :mod:`ast` (no module is imported but the packages whose
public names it reads, which load nothing on import), over ``megatron_ext/``, ``optimizers/``
and ``launch/`` (installed as ``megatron_ext.optimizers`` and ``megatron_ext.launch``).
"""

from __future__ import annotations

import ast
import importlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: folder on disk -> the package it is installed as (setup.py's NAMESPACE_MAP)
SOURCES = {
    "megatron_ext": "megatron_ext",
    "optimizers": "megatron_ext.optimizers",
    "launch": "megatron_ext.launch",
}

#: The layers, lowest first. A package may import its own modules and packages of a lower
#: layer, never one of its own layer or above. ``megatron_ext`` is the root ``__init__``;
#: ``recipes`` the shipped YAML (data, read with importlib.resources).
LAYERS: tuple[tuple[str, ...], ...] = (
    ("megatron_ext", "errors", "verbosity", "exports", "recipes"),
    ("registry", "atomic", "progress"),
    ("commands",),
    ("optimizers",),
    ("data", "distributed", "zo"),
    ("config",),
    ("run", "schedules"),
    ("megatron",),
    ("ckpt",),
    ("gpt",),
    ("soma", "dipaco"),
    ("planner", "convert"),
    ("bench",),
    ("docs",),
    ("launch",),
)
RANK = {package: rank for rank, layer in enumerate(LAYERS) for package in layer}

#: Imports that may reach up or sideways, (importer module, imported module): none. Kept so that
#: an exception, if one is ever needed, is named here one by one and checked to still exist.
PENDING: set[tuple[str, str]] = set()

#: What the benchmarks may import below their public names: the trainer-neutral plumbing they
#: run on (errors, registries, atomic writes, progress on a terminal), not a package's internals
#: (recipes are read through ``megatron_ext.config``'s public names).
BENCH_ANY_MODULE = {"megatron_ext", "errors", "registry", "atomic", "progress", "commands", "bench"}
#: The one reach into a trainer's module that bench keeps, by name: DiPaCo's fault scenarios
#: replace the worker's private lease check to pause a worker at its first check (fault
#: injection, not a use); a fault-injection hook in dipaco/run/worker.py would remove it.
FAULT_INJECTION = {("megatron_ext.bench._dipaco_fault_worker", "megatron_ext.dipaco.run")}


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` (module) imports ``target`` (module or name); ``names`` are what
    a ``from target import ...`` takes (empty for ``import target``)."""

    source: str
    target: str
    names: tuple[str, ...]
    path: str
    line: int

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def package_of(module: str) -> str:
    """``megatron_ext.soma.layout`` -> ``soma``; ``megatron_ext`` -> ``megatron_ext``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = [SOURCES[rel.parts[0]], *rel.parts[1:]]
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, *([node.module] if node.module else [])])


def edges_of(path: Path, module: str | None = None) -> Iterator[Edge]:
    """Every import in one file, wherever it sits (``ast.walk`` enters functions, classes,
    ``if TYPE_CHECKING:`` and ``try`` blocks alike); ``module`` is the file's module name
    (default: from its place in the tree)."""
    module = module or _module_name(path)
    rel = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name
    for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(module, alias.name, (), rel, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            target = _absolute(node, module, path.name == "__init__.py")
            names = tuple(alias.name for alias in node.names)
            yield Edge(module, target, names, rel, node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield Edge(module, node.args[0].value, (), rel, node.lineno)


def _project_edges_of(path: Path, module: str | None = None) -> list[Edge]:
    return [
        edge
        for edge in edges_of(path, module)
        if edge.target == "megatron_ext" or edge.target.startswith("megatron_ext.")
    ]


def _sources() -> list[Path]:
    return sorted(p for folder in SOURCES for p in (ROOT / folder).rglob("*.py"))


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return [edge for path in _sources() for edge in _project_edges_of(path)]


def _targets(edge: Edge) -> list[str]:
    """The modules an edge may name: ``from megatron_ext import soma`` names the package
    ``megatron_ext.soma``, not the root."""
    if edge.target == "megatron_ext" and edge.names:
        return [f"megatron_ext.{name}" for name in edge.names]
    return [edge.target]


def layer_violations(edges: list[Edge]) -> list[str]:
    """Imports that go up the table or sideways within a layer, less :data:`PENDING`."""
    wrong = []
    for edge in edges:
        for target in _targets(edge):
            low, high = package_of(edge.source), package_of(target)
            if low == high or (edge.source, target) in PENDING:
                continue
            if low not in RANK or high not in RANK:
                wrong.append(f"{edge.where}: {low} or {high} is in no layer of LAYERS")
            elif RANK[high] >= RANK[low]:
                wrong.append(f"{edge.where}: {edge.source} imports {target} ({low} -> {high})")
    return wrong


def package_cycles(edges: list[Edge]) -> list[list[str]]:
    """The package graph's strongly connected components of more than one package (Tarjan),
    less :data:`PENDING`."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        for target in _targets(edge):
            low, high = package_of(edge.source), package_of(target)
            if low != high and (edge.source, target) not in PENDING:
                graph.setdefault(low, set()).add(high)
                graph.setdefault(high, set())
    index: dict[str, int] = {}
    lowlink: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = lowlink[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                lowlink[node] = min(lowlink[node], lowlink[nxt])
            elif nxt in stack:
                lowlink[node] = min(lowlink[node], index[nxt])
        if lowlink[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def bench_internal_imports(edges: list[Edge]) -> list[str]:
    """bench's imports of another package that are not ``from megatron_ext.<pkg> import NAME``
    with ``NAME`` in that package's ``__all__``."""
    wrong = []
    for edge in edges:
        if package_of(edge.source) != "bench":
            continue
        for target in _targets(edge):
            package = package_of(target)
            if package in BENCH_ANY_MODULE or (edge.source, target) in FAULT_INJECTION:
                continue
            top = f"megatron_ext.{package}"
            if target != top or not edge.names:
                wrong.append(f"{edge.where}: imports {target} (use `from {top} import NAME`)")
                continue
            public = public_names(package)
            hidden = sorted(set(edge.names) - public)
            if hidden:
                wrong.append(f"{edge.where}: {', '.join(hidden)} not in {top}.__all__")
    return wrong


def public_names(package: str) -> set[str]:
    """The ``__all__`` of ``megatron_ext.<package>``, read from its ``__init__.py`` without
    importing it (importing ``zo`` would import torch): a literal list, or
    ``sorted(_EXPORTS)`` over the literal dict :func:`megatron_ext.exports.load_export` reads."""
    folder = next((f for f, name in SOURCES.items() if name == f"megatron_ext.{package}"), None)
    init = ROOT / (folder or f"megatron_ext/{package}") / "__init__.py"
    if not init.exists():
        return set()
    values: dict[str, ast.expr] = {}
    for node in ast.parse(init.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            values[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value:
            values[node.target.id] = node.value
    listed = values.get("__all__")
    if isinstance(listed, ast.Call) and isinstance(listed.args[0], ast.Name):
        listed = values[listed.args[0].id]  # __all__ = sorted(_EXPORTS)
    if isinstance(listed, ast.Dict):
        return {ast.literal_eval(key) for key in listed.keys if key is not None}
    return set(ast.literal_eval(listed)) if listed is not None else set()


def test_public_names_are_read_as_python_sees_them() -> None:
    """The AST reading of ``__all__`` agrees with the imported packages' (torch-free ones)."""
    for package in ("soma", "dipaco", "gpt", "planner", "data", "optimizers"):
        module = importlib.import_module(f"megatron_ext.{package}")
        assert public_names(package) == set(module.__all__), package


def test_every_package_sits_in_one_layer() -> None:
    on_disk = {package_of(_module_name(p)) for p in _sources()} | {"recipes"}
    listed = [package for layer in LAYERS for package in layer]
    assert len(listed) == len(set(listed)), "a package listed twice in LAYERS"
    assert on_disk ^ set(listed) == set(), "LAYERS and the packages on disk differ"


def test_imports_go_down_the_layers(edges: list[Edge]) -> None:
    assert layer_violations(edges) == []


def test_no_import_cycle_between_packages(edges: list[Edge]) -> None:
    assert package_cycles(edges) == []


def test_pending_edges_still_exist(edges: list[Edge]) -> None:
    """An exception that is no longer needed is removed, not left to excuse a new import."""
    present = {(e.source, t) for e in edges for t in _targets(e)}
    assert PENDING - present == set()


def test_bench_uses_public_names_only(edges: list[Edge]) -> None:
    assert bench_internal_imports(edges) == []


def test_the_architecture_page_draws_this_table() -> None:
    """docs/architecture.md's "Layer order" block lists :data:`LAYERS`, top layer first."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    block = re.search(r"## Layer order\n.*?```\n(.*?)```", text, flags=re.S)
    assert block, "docs/architecture.md has no '## Layer order' section with a code block"
    drawn = [
        tuple(name.strip() for name in line.split(":", 1)[1].split(","))
        for line in block.group(1).splitlines()
        if ":" in line
    ]
    assert drawn == list(reversed(LAYERS))


def test_the_check_sees_lazy_typed_and_dynamic_imports(tmp_path: Path) -> None:
    """A circle hidden in a function, a ``TYPE_CHECKING`` block and an ``import_module`` call
    is found, and so is bench reaching into a module."""
    source = tmp_path / "bench_probe.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from megatron_ext.soma.layout import BodyLayout\n"
        "def f():\n"
        "    from megatron_ext.docs import render\n"
        "    import importlib\n"
        "    return importlib.import_module('megatron_ext.launch.cli')\n"
    )
    found = _project_edges_of(source, "megatron_ext.bench.probe")
    assert [e.target for e in found] == [
        "megatron_ext.soma.layout",
        "megatron_ext.docs",
        "megatron_ext.launch.cli",
    ]
    assert len(layer_violations(found)) == 2  # docs and launch sit above bench
    # soma.layout is a module, render a module not a public name, launch.cli a module
    assert len(bench_internal_imports(found)) == 3
    circle = [*found, Edge("megatron_ext.docs.render", "megatron_ext.bench", ("x",), "d", 1)]
    assert package_cycles(circle) == [["bench", "docs"]]
