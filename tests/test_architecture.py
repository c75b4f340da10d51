"""The shape of the package, checked from its source: the layers only point down (no import cycle, no import up
the layer table of docs/architecture.md, imports inside functions counted), each strategy name is written once,
``utilities/`` only re-exports, no module grows past 500 lines, and ``Fabric.launch`` asks its launcher, not its
type."""

import ast
import shutil
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


def test_no_import_runs_up_the_layer_table_and_every_module_has_a_row():
    table = import_graph.layers(import_graph.ARCHITECTURE.read_text())
    assert ["choices.py"] == table[0] and "strategies/" in table[-4]  # the table was read: lowest row first
    assert import_graph.upward_imports(import_graph.graph(), table) == []


def test_an_import_planted_up_the_table_is_caught_and_so_is_a_module_in_no_row(tmp_path, monkeypatch):
    copy = tmp_path / "fabriclite"
    shutil.copytree(ROOT / "fabriclite", copy, ignore=shutil.ignore_patterns("__pycache__"))
    with open(copy / "checkpoint" / "files.py", "a") as f:  # checkpoints (row 6) reaching up to the facade
        f.write("\n\ndef _planted():\n    from fabriclite.fabric import Fabric\n")
    (copy / "newcomer.py").write_text("")
    monkeypatch.setattr(import_graph, "PACKAGES", {"fabriclite": copy})
    table = import_graph.layers(import_graph.ARCHITECTURE.read_text())
    problems = import_graph.upward_imports(import_graph.graph(), table)
    assert problems == [
        "fabriclite.newcomer is in no row of the layer table",
        f"fabriclite.checkpoint.files (row {len(table) - 5}) imports fabriclite.fabric (row {len(table) - 1}), a higher layer",
    ]


def test_each_strategy_name_has_one_home_and_one_entry_in_its_table():
    from fabriclite.strategies import STRATEGY_NAMES

    home = ROOT / "fabriclite" / "strategies" / "__init__.py"
    names = set(STRATEGY_NAMES) - {"auto"}  # "auto" is also an accelerator and a devices value
    names |= {"ddp", "ddp_spawn", "ddp_fork", "ddp_notebook"}  # the pieces the DDP names are made of
    written_in = {
        str(path.relative_to(ROOT))
        for path in (ROOT / "fabriclite").rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and node.value in names
    }
    assert written_in == {str(home.relative_to(ROOT))}
    table = next(
        node.value
        for node in ast.parse(home.read_text()).body
        if isinstance(node, ast.AnnAssign) and ast.unparse(node.target) == "STRATEGY_NAMES"
    )
    keys = [key.value for key in table.keys if isinstance(key, ast.Constant)]  # a repeated key would silently win
    assert len(keys) > 3 and len(keys) == len(set(keys))


def test_the_utilities_folder_only_re_exports_the_core():
    # Lightning's import paths: a docstring, imports and __all__, so each helper has one home outside utilities/.
    defining = {}
    for path in sorted((ROOT / "fabriclite" / "utilities").glob("*.py")):
        body = ast.parse(path.read_text()).body
        kept = [
            node
            for node in body
            if not isinstance(node, (ast.Import, ast.ImportFrom))
            and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
            and not (isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__")
        ]
        if kept:
            defining[path.name] = [ast.unparse(node).splitlines()[0] for node in kept]
    assert len(list((ROOT / "fabriclite" / "utilities").glob("*.py"))) >= 5 and defining == {}


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
