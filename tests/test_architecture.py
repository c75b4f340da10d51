"""The shape of the package, checked from its source: the layers only point down (no import cycle, no import up
the layer table of docs/architecture.md, imports inside functions counted), each strategy name is written once,
``utilities/`` only re-exports, no private torch name is used
outside the version module, no module grows past 500 lines, and ``Fabric.launch`` asks its launcher, not its type."""

import ast
import re
import shutil
import sys

from helpers import ROOT

sys.path.insert(0, str(ROOT / "tools"))
import import_graph  # noqa: E402

MAX_LINES = 500
VERSION_MODULE = ROOT / "fabriclite" / "_versions.py"
# torch's pretend parts that `fabriclite plan` uses (fake tensors, the fake process group), kept in a second version
# module because _versions.py reached MAX_LINES; the rule is the same for both.
VERSION_MODULES = (VERSION_MODULE, ROOT / "fabriclite" / "_versions_fake.py")


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
    # The table was read: lowest first.
    assert ["_versions.py", "_versions_fake.py"] == table[0] and "strategies/" in table[-4]
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
    # Lightning's import paths: a docstring, imports and __all__, so each helper has one home outside utilities/; or
    # the core module itself under Lightning's name (``sys.modules[__name__] = module``: one module, two paths).
    defining = {}
    for path in sorted((ROOT / "fabriclite" / "utilities").glob("*.py")):
        body = ast.parse(path.read_text()).body
        kept = [
            node
            for node in body
            if not isinstance(node, (ast.Import, ast.ImportFrom))
            and not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
            and not (isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "__all__")
            and not (isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "sys.modules[__name__]")
        ]
        if kept:
            defining[path.name] = [ast.unparse(node).splitlines()[0] for node in kept]
    assert len(list((ROOT / "fabriclite" / "utilities").glob("*.py"))) >= 5 and defining == {}


def _is_private(dotted: str) -> bool:
    parts = dotted.split(".")
    return parts[0] == "torch" and any(p.startswith("_") and not p.endswith("__") for p in parts[1:])


def private_torch_names(source: str) -> list[str]:
    """Each private torch name ``source`` uses: imported (``import torch._dynamo``, ``from torch.utils._device
    import x``, ``from torch.x import _y``), reached as an attribute of something imported from torch
    (``torch._dynamo.reset``, ``dist._make_nccl_premul_sum``, ``FileSystemReader._get_metadata_path``), or named
    in a string (``sys.modules.get("torch._dynamo")``)."""
    tree = ast.parse(source)
    imported: dict[str, str] = {}  # local name -> the torch name it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "torch":
                    imported[alias.asname or "torch"] = alias.name if alias.asname else "torch"
                    found += [f"{node.lineno}: import {alias.name}"] if _is_private(alias.name) else []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                if _is_private(f"{node.module}.{alias.name}"):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"torch(\.\w+)+", node.value) and _is_private(node.value):
                found.append(f"{node.lineno}: {node.value!r}")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(f"torch.{node.attr}"):
            chain, root = [node.attr], node.value
            while isinstance(root, ast.Attribute):
                chain.insert(0, root.attr)
                root = root.value
            if isinstance(root, ast.Name) and root.id in imported:
                found.append(f"{node.lineno}: {'.'.join([root.id, *chain])}")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def test_no_private_torch_name_is_used_outside_the_version_module():
    used = {
        str(path.relative_to(ROOT)): names
        for folder in ("fabriclite", "kernels")
        for path in sorted((ROOT / folder).rglob("*.py"))
        if path not in VERSION_MODULES and (names := private_torch_names(path.read_text()))
    }
    assert used == {}, "use these through fabriclite/_versions.py, which knows which torch versions have them"
    assert len(private_torch_names(VERSION_MODULE.read_text())) >= 5  # the finder sees the ones that belong there


def test_the_private_torch_name_finder_finds_each_way_of_using_one():
    source = """
import torch
import torch.distributed as dist
import torch._dynamo
from torch._guards import CompileContext
from torch.utils import _device
from torch.distributed.checkpoint import FileSystemReader
import sys

torch._dynamo.reset()
dist._make_nccl_premul_sum(0.5)
FileSystemReader._get_metadata_path
sys.modules.get("torch._inductor")
torch.__version__, torch.nn.Linear, dist.all_reduce, sys._getframe, "torch._dynamo is private: say so in text"
"""
    assert private_torch_names(source) == [
        "4: import torch._dynamo",
        "5: from torch._guards import CompileContext",
        "6: from torch.utils import _device",
        "10: torch._dynamo",
        "11: dist._make_nccl_premul_sum",
        "12: FileSystemReader._get_metadata_path",
        "13: 'torch._inductor'",
    ]


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
