"""tools/torch_versions.py deletes the environments it builds, and only those. A CI run failed on what a removal
killed part way had left ("torch-2.11.0 is in the way and was not built by this tool"): rmtree had taken pyvenv.cfg
and the ready mark, then the process was killed, leaving the rest under the version's name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import torch_versions  # noqa: E402


@pytest.fixture
def environments(tmp_path, monkeypatch):
    folder = tmp_path / "environments"
    folder.mkdir()
    monkeypatch.setattr(torch_versions, "ENVIRONMENTS", folder)
    return folder


def make_venv(path: Path) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    (path / "ready").touch()


def test_an_environment_left_half_removed_is_removed_and_a_folder_it_did_not_build_is_left_alone(environments):
    half = environments / "torch-2.11.0"
    make_venv(half)
    (half / "pyvenv.cfg").unlink()  # what rmtree takes first
    (half / "ready").unlink()
    torch_versions.remove(half)
    assert not half.exists()
    assert list(environments.iterdir()) == []

    foreign = environments / "torch-2.8.0"
    (foreign / "bin").mkdir(parents=True)
    (foreign / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError, match=r"torch-2\.8\.0 is in the way and was not built by this tool"):
        torch_versions.remove(foreign)
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_removal_killed_part_way_leaves_the_versions_name_free_and_the_next_run_clears_what_is_left(environments):
    venv = environments / "torch-2.11.0"
    make_venv(venv)
    # A real SIGKILL where the deleting starts: the child renames the environment, then dies.
    child = (
        "import os, shutil, signal, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        "import torch_versions as t; t.shutil.rmtree = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL); "
        "t.remove(Path(sys.argv[2]))"
    )
    result = subprocess.run([sys.executable, "-c", child, str(ROOT / "tools"), str(venv)], timeout=120)
    assert result.returncode == -9
    assert not venv.exists()
    left = [path.name for path in environments.iterdir()]
    assert len(left) == 1 and left[0].startswith(".torch-2.11.0.removing-"), left

    torch_versions.clear_trash()
    assert list(environments.iterdir()) == []
    make_venv(venv)  # the version's name is free for the next build
    assert torch_versions.built_here(venv)
