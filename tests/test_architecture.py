"""The shape of the package, checked from its source: the layers only point down (no import cycle, imports inside
functions counted), no module grows past 500 lines, and ``Fabric.launch`` asks its launcher, not its type."""

import ast
import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import import_graph  # noqa: E402

MAX_LINES = 500


def test_no_import_cycle_among_the_package_modules():
    edges = import_graph.graph()
    assert "fabriclite.fabric" in edges and "fabriclite.strategies.ddp" in edges  # the walk found the package
    assert import_graph.cycles(edges) == []


def test_the_cycle_finder_finds_a_cycle():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert sorted(import_graph.cycles(edges)) == [["a", "b", "c"], ["e"]]


def test_imports_inside_functions_and_relative_imports_count(tmp_path, monkeypatch):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from pkg import high\n")
    (package / "high.py").write_text("from .low import f\n")
    monkeypatch.setattr(import_graph, "PACKAGES", {"pkg": package})
    edges = import_graph.graph()
    assert edges["pkg.low"] == {"pkg.high"} and edges["pkg.high"] == {"pkg.low"}
    assert import_graph.cycles(edges) == [["pkg.high", "pkg.low"]]


def test_no_module_is_longer_than_500_lines():
    long = {
        str(path.relative_to(ROOT)): n
        for folder in ("fabriclite", "kernels")
        for path in (ROOT / folder).rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


def test_fabric_launch_asks_the_launcher_and_never_checks_its_type():
    tree = ast.parse((ROOT / "fabriclite" / "fabric.py").read_text())
    fabric = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Fabric")
    launch = next(node for node in fabric.body if isinstance(node, ast.FunctionDef) and node.name == "launch")
    calls = {
        node.func.id for node in ast.walk(launch) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    }
    assert "isinstance" not in calls and "type" not in calls
    assert "launcher.launch" in ast.unparse(launch)
