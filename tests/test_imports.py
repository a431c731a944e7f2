"""No import cycle among repack's modules (issue 25, item 4).

Every module under ``repack/`` is parsed with :mod:`ast`, not imported. Each import of a repack
module is an edge, at module level and inside functions alike (a function's import runs, and
can fail half-initialized, the first time the function is called); only the body of
``if TYPE_CHECKING:`` is left out, since it never runs.

Where an edge goes:

* ``import repack.a.b`` and ``from repack.a.b import name``: to ``repack.a.b``;
* ``from repack.a import b``, ``b`` a submodule: to ``repack.a.b`` (so
  ``from repack.merge import steps`` is an edge to ``repack.merge.steps``); ``b`` any other
  name: to ``repack.a``, that is to the package's ``__init__``;
* relative imports are resolved against the importing module's package first.

A package stands for its ``__init__`` module, and its edges are the imports written in that
``__init__``. Importing ``repack.a.b`` also runs ``repack.a``'s ``__init__`` first: from a
module outside ``repack.a`` that is counted as a second edge, to ``repack.a`` (it is how
``import repack.merge.append`` comes to run ``repack/merge/__init__.py``); from a module inside
``repack.a`` it is not, since ``repack.a``'s ``__init__`` has run (or is running) before any of
its submodules does. So an ``__init__`` that re-exports its submodules makes no false cycle
``repack.a -> repack.a.b -> repack.a``, while a submodule that imports a *name* from its
``__init__`` (``from repack.a import name``, ``name`` no submodule) has an edge to ``repack.a``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import repack

Edge = tuple[str, str, int, str]  # target module, file, line, the import statement


def _modules(root: Path, package: str) -> dict[str, Path]:
    """Every module of ``package`` (a folder ``root``): dotted name -> file."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imports(tree: ast.AST):
    """The import nodes of ``tree``, anywhere but under ``if TYPE_CHECKING:``."""
    todo = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def import_graph(root: Path, package: str) -> dict[str, list[Edge]]:
    """Each module of ``package`` -> its edges to the package's modules (see the docstring)."""
    modules = _modules(root, package)
    graph: dict[str, list[Edge]] = {name: [] for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here.rsplit(".", node.level - 1)[0]  # level 1: this package
                    base = f"{anchor}.{base}" if base else anchor
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            text, location = ast.unparse(node), str(path.relative_to(root.parent))
            for target in dict.fromkeys(targets):
                edges = {target: text}
                parts = target.split(".")
                for n in range(1, len(parts)):  # the packages the import runs first
                    parent = ".".join(parts[:n])
                    if not f"{name}.".startswith(f"{parent}."):
                        edges.setdefault(parent, f"{text}  (runs {parent}'s __init__)")
                for to, why in edges.items():
                    if to in modules and to != name:
                        graph[name].append((to, location, node.lineno, why))
        graph[name].sort(key=lambda edge: (edge[2], edge[0]))
    return graph


def strongly_connected(graph: dict[str, list[Edge]]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted({e[0] for e in graph[start]})))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted({e[0] for e in graph[successor]}))))
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
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
    return sorted(found)


def _shortest_cycle(graph: dict[str, list[Edge]], start: str, members: set[str]) -> list[Edge]:
    """The fewest edges from ``start`` back to it, within ``members`` (breadth first)."""
    came: dict[str, tuple[str, Edge]] = {}  # module reached -> (from where, by which edge)
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for edge in graph[node]:
                if edge[0] == start:
                    path = [edge]
                    while node != start:
                        node, by = came[node]
                        path.append(by)
                    return path[::-1]
                if edge[0] in members and edge[0] not in came:
                    came[edge[0]] = (node, edge)
                    following.append(edge[0])
        frontier = following
    raise AssertionError(f"{start} is on no cycle")


def cycles_report(graph: dict[str, list[Edge]]) -> str:
    """Each cycle as ``a -> b -> a``, with the file and line of each import; empty if none."""
    out = []
    for component in strongly_connected(graph):
        members = set(component)
        out.append(f"import cycle among {len(component)} modules: {', '.join(component)}")
        covered: set[str] = set()
        for start in component:
            if start in covered:
                continue
            path = _shortest_cycle(graph, start, members)
            chain = [start] + [edge[0] for edge in path]
            covered.update(chain)
            out.append("  " + " -> ".join(chain))
            out.extend(f"      {file}:{line}: {text}" for _, file, line, text in path)
    return "\n".join(out)


def test_no_import_cycle():
    root = Path(repack.__file__).parent
    report = cycles_report(import_graph(root, "repack"))
    if report:
        pytest.fail(f"repack's modules import each other in a circle:\n{report}", pytrace=False)


def test_a_cycle_is_found(tmp_path):
    """The checker itself, on a synthetic package: a cycle through a function's import, a
    relative import and ``from pkg.sub import module``, and one through a package's
    ``__init__`` run by an import from outside it; an ``__init__`` that re-exports its
    submodules and a ``TYPE_CHECKING`` import add none."""
    files = {
        "__init__.py": "from pkg.a import A\nfrom pkg.sub import c\nfrom pkg.tools import E\n",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import leaf\n"
        "A = 1\ndef f():\n    from .sub import c\n",
        "leaf.py": "import pkg.a\n",
        "sub/__init__.py": "",
        "sub/c.py": "from pkg.sub import d\n",
        "sub/d.py": "from ..a import A\n",
        "b.py": "from pkg.tools.e import E\nB = E\n",
        "tools/__init__.py": "from pkg.tools.e import E\nfrom pkg.b import B\n",
        "tools/e.py": "E = 1\n",
    }
    for name, text in files.items():
        (tmp_path / "pkg" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "pkg" / name).write_text(text)
    graph = import_graph(tmp_path / "pkg", "pkg")
    assert strongly_connected(graph) == [
        ["pkg.a", "pkg.sub.c", "pkg.sub.d"],
        ["pkg.b", "pkg.tools"],
    ]
    report = cycles_report(graph).splitlines()
    assert "  pkg.a -> pkg.sub.c -> pkg.sub.d -> pkg.a" in report
    assert "      pkg/a.py:6: from .sub import c" in report
    assert "      pkg/sub/d.py:1: from ..a import A" in report
    assert "  pkg.b -> pkg.tools -> pkg.b" in report
    assert "      pkg/b.py:1: from pkg.tools.e import E  (runs pkg.tools's __init__)" in report
