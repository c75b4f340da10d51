"""The import graph of the fabriclite package, read from the source with ``ast`` (imports inside functions count
too), its cycles (the strongly connected components with more than one module, or a module importing itself), and
the imports that run up the layer table of docs/architecture.md (from a row to a later one).

Usage: ``python tools/import_graph.py`` prints each cycle and each upward import and exits 1 if there is one;
``--graph`` prints every edge.
An import of ``a.b.c`` is an edge to ``a.b.c`` only: Python also runs the parent packages' ``__init__``, but a
package that re-exports its modules would otherwise put every module in one cycle with it.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "architecture.md"
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


def layers(markdown: str) -> list[list[str]]:
    """The "Where" cell of each row of the table under "## Layers", lowest layer first: the files (``choices.py``)
    and folders (``checkpoint/``) it names, relative to ``fabriclite/`` (``kernels/`` is ``fabriclite.kernels``)."""
    section = markdown.split("## Layers", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")][2:]  # past the header and |---|
    cells = [line.split("|")[2] for line in lines]
    return [[entry for entry in re.findall(r"`([^`]+)`", cell) if entry.endswith((".py", "/"))] for cell in cells]


def layer_of(module: str, path: Path, table: list[list[str]]) -> int | None:
    """The row of ``table`` that holds ``module`` (the most specific entry wins: a file over its folder), or None."""
    parts = module.split(".")[1:]
    where = "/".join(parts + ["__init__.py"]) if path.name == "__init__.py" else "/".join(parts) + ".py"
    best: tuple[int, int] | None = None  # (length of the entry, row)
    for row, entries in enumerate(table):
        for entry in entries:
            if where == entry or (entry.endswith("/") and where.startswith(entry)):
                if best is None or len(entry) > best[0]:
                    best = (len(entry), row)
    return None if best is None else best[1]


def upward_imports(edges: dict[str, set[str]], table: list[list[str]]) -> list[str]:
    """Each import from a module to one in a later (higher) row of ``table``, and each module in no row."""
    paths = modules()
    rows = {name: layer_of(name, paths[name], table) for name in edges}
    problems = [f"{name} is in no row of the layer table" for name, row in sorted(rows.items()) if row is None]
    for name in sorted(edges):
        for target in sorted(edges[name]):
            if rows[name] is not None and rows[target] is not None and rows[target] > rows[name]:
                problems.append(
                    f"{name} (row {rows[name] + 1}) imports {target} (row {rows[target] + 1}), a higher layer"
                )
    return problems


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
    upward = upward_imports(edges, layers(ARCHITECTURE.read_text()))
    for problem in upward:
        print(problem)
    if not upward:
        print("no import runs up the layer table of docs/architecture.md")
    return 1 if found or upward else 0


if __name__ == "__main__":
    sys.exit(main())
