"""The version module (``fabriclite._versions``): the oldest torch it accepts is the one pyproject.toml,
the README and CI name, an older one is refused at import saying which is installed and which is needed, and the
fallbacks it keeps for versions that lack a torch name."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, python_env
from torch.distributed.checkpoint import FileSystemReader

from fabriclite._versions import TORCH_FLOOR, check_torch_version, dcp_metadata_path, traced_triton_launch

pytestmark = pytest.mark.torch_versions  # also run on the other torch versions CI tests
FLOOR = ".".join(map(str, TORCH_FLOOR))


def test_import_fabriclite_with_a_torch_below_the_floor_names_the_installed_and_the_needed_version():
    # CI cannot install every old torch; the version string is what the check reads, so the child sets it.
    code = "import torch; torch.__version__ = '2.7.1+cu126'; import fabriclite"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=python_env(), timeout=120)
    assert result.returncode != 0
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fabriclite needs torch >= 2.8") and "torch 2.7.1+cu126 is installed" in last


@pytest.mark.parametrize("version", ["2.8.0", "2.8.0+cu128", "2.15.0", "3.0.0a0", torch.__version__])
def test_the_floor_and_newer_torch_versions_are_accepted(version):
    check_torch_version(version)


@pytest.mark.parametrize("version", ["2.7.1", "2.6.0+cpu", "1.13.1"])
def test_older_torch_versions_are_refused(version):
    with pytest.raises(ImportError, match=rf"needs torch >= {FLOOR}, .* torch {re.escape(version)} is installed"):
        check_torch_version(version)


def test_pyproject_the_readme_and_ci_state_the_floor_the_version_module_enforces():
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=([0-9.]+)"', pyproject).group(1) == FLOOR
    tested = [
        line.split()[0]
        for line in (ROOT / "requirements-torch-versions.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert tested[0] == f"torch=={FLOOR}.0" and len(tested) >= 3  # CI runs the floor, a middle one, the newest
    newest = tested[-1].split("==")[1].rsplit(".", 1)[0]
    for page in ("README.md", "docs/index.md"):
        assert f"torch {FLOOR} to {newest}" in (ROOT / page).read_text(), page


def test_the_dcp_metadata_file_is_found_with_or_without_torchs_own_helper(tmp_path):
    assert dcp_metadata_path(FileSystemReader(tmp_path), None) == tmp_path / ".metadata"

    class OlderReader:  # torch 2.8's reader has no _get_metadata_path
        path = str(tmp_path)

    assert dcp_metadata_path(OlderReader(), None) == Path(tmp_path) / ".metadata"


def test_a_kernel_launch_goes_into_a_graph_only_while_compile_traces_it():
    # torch leaves wrap_triton's switch on outside any trace, and torch 2.8 to 2.12 refuse the interpreter's kernels
    # there: a launch on a real tensor (a parameter too) goes straight to the kernel.
    from torch._library.triton import set_wrap_triton_enabled
    from torch._subclasses.fake_tensor import FakeTensorMode

    real = torch.randn(3)
    assert not traced_triton_launch(real)
    assert not traced_triton_launch(torch.nn.Parameter(real))
    with FakeTensorMode():
        fake = torch.randn(3)
    assert traced_triton_launch(fake)
    with set_wrap_triton_enabled(False):  # what a triton_op's eager call does
        assert not traced_triton_launch(fake)


COUNTED = """
import sys
import torch, torch.distributed as dist
from fabriclite import Fabric
from fabriclite._versions import collective_count

fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
calls, world = fabric.strategy.calls_group, dist.group.WORLD
before = collective_count(calls), collective_count(world)
fabric.barrier()
fabric.all_reduce(torch.ones(1))
dist.all_reduce(torch.ones(1))
counts = fabric.global_rank, collective_count(calls) - before[0], collective_count(world) - before[1]
with open(f"{sys.argv[1]}/counted-{fabric.global_rank}", "w") as f:  # one file a rank: printed lines interleave
    f.write(" ".join(map(str, counts)))
"""


def test_the_collectives_each_rank_issued_are_counted_per_group_as_the_watchdog_reads_them(tmp_path):
    # The watchdog proves a call some ranks skipped from these counts: on every torch CI tests, each group counts
    # its own collectives (Fabric's calls on the calls group, the training's on the default one).
    script = tmp_path / "counted.py"
    script.write_text(COUNTED)
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, env=python_env(), timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    counted = sorted((tmp_path / f"counted-{rank}").read_text() for rank in (0, 1))
    assert counted == ["0 2 1", "1 2 1"], counted
