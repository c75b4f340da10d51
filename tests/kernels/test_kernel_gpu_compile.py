"""Every kernel compiles to GPU code with Triton's own compiler (and its bundled ptxas), no GPU needed.

The interpreter runs kernel bodies as Python, so it accepts code the compiler refuses (a loop variable changing
type, an unsupported construct) and says nothing about register use. ``compiled_kernels.py`` compiles, for sm_90,
every launch the ops' host code makes (recorded over the options that set the kernels' compile-time flags), each
with the argument types of an eager launch and those Inductor gives a Triton kernel inside ``torch.compile``
(floats fp64, sizes i64): on an H200, linear cross-entropy failed to compile under Inductor (a loop-carried fp32
variable turned fp64 by ``softcap``), and the norms and cross-entropy computed in fp64, while every interpreter
test passed.
"""

import re

import pytest
from helpers import ROOT, run_python

KERNELS = {
    f"_{op}_{direction}_kernel"
    for op in ("cross_entropy", "norm", "linear_cross_entropy", "bias_gelu", "rope", "swiglu")
    for direction in ("forward", "backward")
}


@pytest.mark.torch_versions  # each torch brings its own Triton compiler
def test_every_kernel_launch_compiles_for_a_gpu_as_launched_eagerly_and_by_inductor_and_computes_in_fp32():
    result = run_python(str(ROOT / "tests" / "kernels" / "compiled_kernels.py"), timeout=600, check=False)
    out = result.stdout
    assert result.returncode == 0, out + result.stderr[-3000:]
    problems = [line for line in out.splitlines() if line.startswith(("FAIL ", "FP64 "))]
    assert not problems, "\n".join(problems)
    summary = re.search(r"^compiled (\d+) launches of \d+ kernels: (\S+)$", out, re.MULTILINE)
    assert summary is not None, out
    assert set(summary.group(2).split(",")) == KERNELS, out
    assert int(summary.group(1)) > len(KERNELS), out  # several flag combinations per kernel


def test_the_norm_backward_register_report_covers_both_designs_and_the_tiles_spill_nothing():
    # benchmarks/kernel_registers.py: the CPU proxy for the norm backward's design (what fits on a multiprocessor).
    result = run_python(str(ROOT / "benchmarks" / "kernel_registers.py"), "--widths", "768", timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    if "no register counts" in result.stdout or "no NVIDIA backend" in result.stdout:
        pytest.skip(result.stdout.strip())
    rows = [line.split(" | ") for line in result.stdout.splitlines() if line.startswith("| 768 |")]
    assert {(row[1], row[2]) for row in rows} == {
        (design, op)
        for design in ("tiles", "row loop")
        for op in ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm")
    }, result.stdout
    assert all(int(row[6]) > 0 for row in rows), result.stdout  # registers
    assert all(int(row[7]) == 0 for row in rows if row[1] == "tiles"), result.stdout  # spill bytes
