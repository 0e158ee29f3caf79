"""bloomnative's modules depend on each other one way only (docs/architecture.md): a cycle (as
interop -> train -> interop once was, or parallel.layout_check <-> parallel.pipeline) means
neither side can be used, tested or understood without the other. Read from the source with
`ast`: every import counts, those inside functions and under `if TYPE_CHECKING:` included (a
module that needs another's types to be read depends on it)."""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "src"
# The one edge against the grain: `Bloom.from_pretrained_hf`/`save_pretrained_hf` are methods of
# the model, the public API users import (docs/api.md), so the model reaches up to interop; they
# import the converter lazily, inside the methods.
FACADE = ("bloomnative.model.bloom", "bloomnative.interop.hf")
# And one former name: the worker entry moved to the launcher, and `python -m
# bloomnative.train.main` still starts it (for command lines written before the move).
ALIAS = ("bloomnative.train.main", "bloomnative.launch.worker")


def modules() -> dict[str, Path]:
    """Every module of bloomnative by dotted name (a package by its own name), the kernels
    included: `os.walk` follows the src/bloomnative/kernels link where `Path.rglob` may not."""
    found = {}
    for folder, _, files in os.walk(SOURCE / "bloomnative", followlinks=True):
        for name in files:
            if name.endswith(".py"):
                parts = (Path(folder) / name).relative_to(SOURCE).with_suffix("").parts
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = (
                    Path(folder) / name
                )
    return found


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `module` imports: `from a import b` is module a.b where
    there is one, else a's package."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
            continue
        if not isinstance(node, ast.ImportFrom):
            continue
        base = node.module or ""
        if node.level:  # relative: resolve against the file's package
            parent = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*parent, base] if base else parent)
        for alias in node.names:
            found.add(sub if (sub := f"{base}.{alias.name}") in known else base)
    return found & known


def module_graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) - {name} for name, path in found.items()}


def _unit(module: str) -> str:
    """The package (or top-level module) of bloomnative that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, deps in module_graph().items():
        unit = _unit(module)
        graph.setdefault(unit, set()).update(_unit(d) for d in deps if _unit(d) != unit)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], _ = "open", stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node], _ = "done", stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def without_facade(graph: dict[str, set[str]], edge: tuple[str, str]) -> dict[str, set[str]]:
    assert edge[1] in graph[edge[0]], f"the edge {edge} is gone: drop it from this test"
    return {node: deps - {edge[1]} if node == edge[0] else deps for node, deps in graph.items()}


def test_the_package_graph_has_no_cycle():
    graph = {unit: deps for unit, deps in package_graph().items() if unit != "__init__"}
    for edge in (FACADE, ALIAS):
        graph = without_facade(graph, (_unit(edge[0]), _unit(edge[1])))
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_module_graph_has_no_cycle():
    """Also inside a package: no module imports, however lazily, a module that imports it."""
    graph = without_facade(without_facade(module_graph(), FACADE), ALIAS)
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_nothing_imports_the_workers_former_name():
    """`bloomnative.train.main` only keeps `python -m bloomnative.train.main` working."""
    importers = [m for m, deps in module_graph().items() if ALIAS[0] in deps]
    assert importers == []


def documented_imports() -> dict[str, set[str]]:
    """docs/architecture.md's table: package -> the packages it may import ("all of the above":
    every package of an earlier row)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    rows = re.findall(r"^\| `bloomnative\.(\w+)`[^|]*\|[^|]*\|([^|]*)\|$", text, flags=re.MULTILINE)
    allowed: dict[str, set[str]] = {}
    for unit, imports in rows:
        earlier = set(allowed)
        named = set(re.findall(r"`(\w+)`", imports)) & {u for u, _ in rows}
        allowed[unit] = earlier if "all of the above" in imports else named
    return allowed


def test_every_package_imports_only_what_docs_architecture_allows():
    graph = {unit: deps for unit, deps in package_graph().items() if unit != "__init__"}
    allowed = documented_imports()
    assert sorted(allowed) == sorted(graph), "docs/architecture.md's table lists other packages"
    graph["train"] = graph["train"] - {"launch"}  # ALIAS, the worker's former name
    extra = {
        unit: sorted(deps - allowed[unit]) for unit, deps in graph.items() if deps - allowed[unit]
    }
    assert not extra, f"imports docs/architecture.md does not allow: {extra}"
    assert allowed["log"] == allowed["kernels"] == set()
    assert allowed["data"] == {"log", "kernels"}  # kernels: segment_bounds of micro batches
    assert "launch" not in allowed["train"]  # the training loop imports nothing of its launcher
    assert "train" in allowed["launch"]


def test_the_kernels_are_found_through_the_package():
    found = modules()
    assert found["bloomnative.kernels.layer_norm"].resolve() == REPO / "kernels" / "layer_norm.py"


def test_a_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_every_kind_of_import_counts(tmp_path):
    source = tmp_path / "m.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from pkg import typed\n"
        "def f():\n    from pkg.lazy import thing\n"
        "from . import sibling, name_in_init\n"
        "import pkg.plain\n"
    )
    known = {"pkg", "pkg.typed", "pkg.lazy", "pkg.sibling", "pkg.plain", "pkg.m"}
    assert imports_of("pkg.m", source, known) == {
        "pkg",
        "pkg.typed",
        "pkg.lazy",
        "pkg.sibling",
        "pkg.plain",
    }
