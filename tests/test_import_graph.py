"""The import graph of the kvstore and connector packages has no cycle.

A cycle is a knot a newcomer cannot read from the bottom up (and, at import time, a module seen half built).
Edges come from the source, parsed with `ast`: module-level, function-level and `if TYPE_CHECKING:` imports
all count (a lazy import inside a function still ties the two modules together, and a module that names
another's class in its annotations depends on it as surely as one that calls it: each file's dependencies
point one way). `from a.b import c` is an edge to the module `a.b.c` when
that is a module, else to the package `a.b` (its `__init__`); a module not in the tree (third-party, or
generated like kvstore._proto) is no edge. The implicit import of a module's parent
packages is not an edge: a package `__init__` that re-exports its own submodules would otherwise be a cycle
with each of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvstore", "kvstore_connector", "connector")

# Known cycles outside the files being restructured, each as the sorted modules of its strongly connected
# component. A shrinking allowlist: remove an entry when its cycle is untied; never add one.
KNOWN_CYCLES: set[tuple[str, ...]] = set()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if "__pycache__" not in path.parts:
                out[_module_name(path)] = path
    return out


def _imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, at any depth (TYPE_CHECKING blocks included)."""
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in _imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                       for alias in node.names]
        # a name outside the tree (a third-party or generated module such as kvstore._proto) is no edge
        out.update(t for t in targets if t in modules and t != name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _edges(name, path, modules) for name, path in modules.items()}


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    comp.append(top)
                    if top == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def _cycle_in(graph: dict[str, set[str]], comp: list[str]) -> list[str]:
    """One concrete cycle through the component's first module (breadth-first: a shortest one)."""
    members, start = set(comp), comp[0]
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in parent:
                    parent[child] = node
                    nxt.append(child)
        frontier = nxt
    raise AssertionError(f"no cycle found in component {comp}")


def test_the_graph_is_complete() -> None:
    """The parser sees the packages (a walk that found nothing would pass the cycle test vacuously)."""
    graph = import_graph()
    assert "kvstore.engine.engine" in graph and "kvstore_connector.vllm_connector" in graph
    assert "kvstore.engine.catalog" in graph["kvstore.engine.engine"]


def test_no_import_cycle() -> None:
    graph = import_graph()
    comps = [tuple(c) for c in _components(graph)]
    new = [c for c in comps if c not in KNOWN_CYCLES]
    shown = "\n".join(" -> ".join(_cycle_in(graph, list(c))) + f"   (component: {', '.join(c)})" for c in new)
    assert not new, f"import cycles:\n{shown}"
    gone = KNOWN_CYCLES - set(comps)
    assert not gone, f"these known cycles are untied: remove them from KNOWN_CYCLES: {sorted(gone)}"


def test_the_checker_finds_a_cycle() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _components(graph) == [["a", "b", "c"]]
    assert _cycle_in(graph, ["a", "b", "c"]) == ["a", "b", "c", "a"]
