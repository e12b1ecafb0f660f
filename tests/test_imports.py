"""No import circles in rolloutgate (issue 21, item 8). The module graph is built from the AST of every file, so
an import inside a function or under `if TYPE_CHECKING:` counts: a type-only cycle is still a circle in the design."""

from __future__ import annotations

import ast
from collections import deque
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"

Edges = dict[str, dict[str, str]]  # module -> imported module -> "file:line" of the first such import


def module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def import_graph(root: Path) -> Edges:
    """Edges to the package's own modules. `from p import x` is an edge to p.x when that is a module, else to p;
    a package's __init__ is reached only by naming the package itself, not by importing one of its submodules."""
    modules = module_names(root)
    graph: Edges = {name: {} for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for target in targets:
                if target in modules and target != name:
                    graph[name].setdefault(target, f"{path.relative_to(root.parent)}:{node.lineno}")
    return graph


def cycles(graph: Edges) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = len(index)
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(graph[succ])))
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
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
    return found


def one_circle(graph: Edges, component: list[str]) -> list[str]:
    """The edges of one shortest path from the component's first module back to itself, as "a -> b (file:line)"."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        node = queue.popleft()
        for succ in graph[node]:
            if succ in members and succ not in came_from:
                came_from[succ] = node
                queue.append(succ)
        if start in came_from:
            break
    path, node = [], start
    while True:
        path.append(f"{came_from[node]} -> {node} ({graph[came_from[node]][node]})")
        node = came_from[node]
        if node == start:
            return path[::-1]


def describe(graph: Edges) -> str:
    return "\n".join(
        f"cycle of {len(c)} modules: {', '.join(c)}\n  " + "\n  ".join(one_circle(graph, c))
        for c in cycles(graph)
    )


def test_rolloutgate_has_no_import_cycles() -> None:
    graph = import_graph(SRC / "rolloutgate")
    assert len(graph) > 100
    if cycles(graph):
        pytest.fail("import cycles:\n" + describe(graph), pytrace=False)


def test_the_checker_catches_a_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import A\n")
    (pkg / "a.py").write_text("A = 1\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n"
    )
    (pkg / "sub" / "c.py").write_text("def f():\n    from .. import a\n    from pkg.sub import b\n")
    graph = import_graph(pkg)
    assert graph["pkg"] == {"pkg.a": "pkg/__init__.py:1"}  # __init__ importing its children is no cycle
    assert cycles(graph) == [["pkg.sub.b", "pkg.sub.c"]]
    assert one_circle(graph, ["pkg.sub.b", "pkg.sub.c"]) == [
        "pkg.sub.b -> pkg.sub.c (pkg/sub/b.py:3)",
        "pkg.sub.c -> pkg.sub.b (pkg/sub/c.py:3)",
    ]
    assert "pkg.sub.c" in graph["pkg.sub.b"] and "pkg.a" in graph["pkg.sub.c"]
