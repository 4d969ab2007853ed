"""No import cycle among the project's modules, imports inside functions counted: grimp (import-linter's graph)
reads every import statement. Import-linter's layers contract alone misses a cycle inside one layer, and an import
inside a function hides one from a reader as well."""

from __future__ import annotations

import itertools
from pathlib import Path

import grimp

ROOTS = ("pagedkv", "gateway", "executor", "blockd", "pagedkv_kernels", "common")
REPO = Path(__file__).resolve().parents[1]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
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


def _describe(graph: grimp.ImportGraph, component: list[str]) -> str:
    """One cycle through the component, each import with the line it is on."""
    first = component[0]
    members = set(component)
    second = min(m for m in graph.find_modules_directly_imported_by(first) if m in members)
    back = graph.find_shortest_chain(importer=second, imported=first) or (second, first)
    chain = [first, *back]
    lines = []
    for importer, imported in itertools.pairwise(chain):
        details = graph.get_import_details(importer=importer, imported=imported)
        where = ", ".join(f"line {d['line_number']}: {d['line_contents']}" for d in details)
        lines.append(f"  {importer} -> {imported} ({where})")
    return f"cycle among {', '.join(component)}:\n" + "\n".join(lines)


def test_every_package_directory_is_a_package() -> None:
    """A folder of modules without __init__.py is a namespace package, which grimp and import-linter skip."""
    missing = [
        str(folder.relative_to(REPO))
        for root in ROOTS
        for folder in [REPO / root, *(REPO / root).rglob("*")]
        if folder.is_dir() and any(folder.glob("*.py")) and not (folder / "__init__.py").is_file()
    ]
    assert not missing, f"folders of modules without __init__.py (invisible to the import checks): {missing}"


def test_no_import_cycle() -> None:
    graph = grimp.build_graph(*ROOTS, cache_dir=None)
    modules = {m for m in graph.modules if m.split(".")[0] in ROOTS}
    edges = {m: {x for x in graph.find_modules_directly_imported_by(m) if x in modules} for m in modules}
    cycles = _cycles(edges)
    assert not cycles, "\n".join(_describe(graph, c) for c in cycles)
