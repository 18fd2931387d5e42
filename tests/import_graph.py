"""The import graph of ``pipeline/``, computed from the code: every ``import`` and ``from ...
import``, at module level or deferred into a function or a ``TYPE_CHECKING`` block, as an
edge from the importing module to the ``pipeline`` module it names.

    python -m tests.import_graph        # the package graph, as DESIGN.md draws it
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pipeline"


def modules() -> dict[str, Path]:
    """Dotted name → file, for every module of ``pipeline`` (a package by its ``__init__``)."""
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = f.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def edges() -> dict[str, set[str]]:
    """Module → the ``pipeline`` modules it imports (itself and its own packages left out)."""
    mods = modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, base] if base else up)
                named = [base, *(f"{base}.{a.name}" for a in node.names)]
            else:
                continue
            for target in named:
                found = _longest_module(target, mods)
                if found and found != name and not name.startswith(found + "."):
                    graph[name].add(found)
    return graph


def _longest_module(dotted: str, mods: dict[str, Path]) -> str | None:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in mods:
            return ".".join(parts[:i])
    return None


def package_of(module: str) -> str:
    """``pipeline.store.s3`` → ``pipeline.store``; a top-level module is its own."""
    parts = module.split(".")
    return ".".join(parts[:2])


def package_edges() -> dict[str, set[str]]:
    out: dict[str, set[str]] = defaultdict(set)
    for a, targets in edges().items():
        for b in targets:
            if package_of(a) != package_of(b):
                out[package_of(a)].add(package_of(b))
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    return found


if __name__ == "__main__":
    for package, targets in sorted(package_edges().items()):
        print(f"{package:<22} -> {', '.join(sorted(targets))}")
