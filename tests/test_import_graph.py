"""The packages of bloomnative depend on each other one way only: a cycle between two of them
(as interop -> train -> interop once was) means neither can be used, tested or understood
without the other. Read from the source with `ast`, lazy imports inside functions included."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ROOTS = {"bloomnative": REPO / "src" / "bloomnative", "bloomnative.kernels": REPO / "kernels"}
# The one edge against the grain: DESIGN.md puts `Bloom.from_pretrained_hf`/`save_pretrained_hf`
# on the model; they import the converter lazily, inside the methods.
FACADE = ("model", "interop")


def _unit(module: str) -> str | None:
    """The package or top-level module of bloomnative that `module` belongs to."""
    parts = module.split(".")
    return parts[1] if parts[0] == "bloomnative" and len(parts) > 1 else None


def _imports(path: Path, package: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the file's package
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                found.add(".".join([*base, node.module] if node.module else base))
            elif node.module:
                found.add(node.module)
    return found


def package_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for root_name, root in ROOTS.items():
        for path in root.rglob("*.py"):
            rel = path.relative_to(root).with_suffix("").parts
            module = ".".join([root_name, *rel])
            package = module if rel[-1] == "__init__" else module.rsplit(".", 1)[0]
            unit = _unit(module.removesuffix(".__init__")) or "__init__"
            deps = {_unit(m) for m in _imports(path, package.removesuffix(".__init__"))}
            graph.setdefault(unit, set()).update(d for d in deps if d and d != unit)
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


def test_the_package_graph_has_no_cycle():
    graph = {unit: deps for unit, deps in package_graph().items() if unit != "__init__"}
    assert FACADE[1] in graph[FACADE[0]], "the facade is gone: drop FACADE"
    graph[FACADE[0]].discard(FACADE[1])
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_model_and_the_kernels_stand_alone():
    graph = package_graph()
    assert graph["kernels"] == set()
    assert graph["model"] <= {"kernels", FACADE[1]}
    assert not graph["interop"] & {"train", "parallel", "data"}


def test_a_cycle_is_found():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
