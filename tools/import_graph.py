"""The import graph of the fabriclite package, read from the source with ``ast`` (imports inside functions count
too), and its cycles: the strongly connected components with more than one module, or a module importing itself.

Usage: ``python tools/import_graph.py`` prints each cycle and exits 1 if there is one; ``--graph`` prints every edge.
An import of ``a.b.c`` is an edge to ``a.b.c`` only: Python also runs the parent packages' ``__init__``, but a
package that re-exports its modules would otherwise put every module in one cycle with it.
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The installed name of each source folder (kernels/ is installed as fabriclite.kernels).
PACKAGES = {"fabriclite": ROOT / "fabriclite", "fabriclite.kernels": ROOT / "kernels"}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__.py``)."""
    found = {}
    for name, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join([name, *parts])] = path
    return found


def _resolve(module: str, level: int, current: str, is_package: bool) -> str:
    if level == 0:
        return module
    base = current.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([module] if module else []))


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that ``name`` imports anywhere in its source."""
    tree = ast.parse(path.read_text(), filename=str(path))
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, name, path.name == "__init__.py")
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                targets.add(submodule if submodule in known else base)
    return {t for t in targets if t in known and t != name} | ({name} if name in targets else set())


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports_of(name, path, set(found)) for name, path in found.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm), plus self-imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in edges[node]:
                found.append(sorted(component))

    sys.setrecursionlimit(max(1000, 10 * len(edges)))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graph", action="store_true", help="print every edge")
    args = parser.parse_args(argv)
    edges = graph()
    if args.graph:
        for name in sorted(edges):
            print(f"{name} -> {', '.join(sorted(edges[name])) or '-'}")
    found = cycles(edges)
    for component in found:
        print(f"import cycle through {len(component)} modules: {', '.join(component)}")
    if not found:
        print(f"no import cycle among {len(edges)} modules")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
