"""Every kernel compiles to GPU code with Triton's own compiler (and its bundled ptxas), no GPU needed.

The interpreter runs kernel bodies as Python, so it accepts code the compiler refuses (a loop variable changing
type, an unsupported construct) and says nothing about register use. Compiling for sm_90 in a child process, with
TRITON_INTERPRET=0 so the kernels are real JITFunctions, closes that gap. Each kernel compiles with its constexpr
flags all on and all off; the signature is derived from the parameter names the op files use.
"""

import pytest
from helpers import ROOT, run_python

CHILD = r"""
import sys
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton
except ImportError as error:
    sys.exit(f"SKIP: this triton cannot compile ahead of time ({error})")
from fabriclite.kernels import (
    _linear_cross_entropy_kernels, _norm, fused_bias_gelu, fused_cross_entropy, fused_rope, fused_swiglu,
)

FP32_POINTERS = {"loss_ptr", "n_valid_ptr", "mean_ptr", "rstd_ptr", "stats_ptr", "state_ptr", "dweight_partial_ptr", "dbias_partial_ptr", "partials_ptr"}
BLOCKS = {"BLOCK": 1024, "BLOCK_M": 4, "BLOCK_N": 1024, "BLOCK_H": 32, "BLOCK_HALF": 64, "ROWS": 4}
KERNELS = [
    fused_cross_entropy._cross_entropy_forward_kernel, fused_cross_entropy._cross_entropy_backward_kernel,
    _norm._norm_forward_kernel, _norm._norm_backward_kernel,
    _linear_cross_entropy_kernels._linear_cross_entropy_forward_kernel,
    _linear_cross_entropy_kernels._linear_cross_entropy_backward_kernel,
    fused_bias_gelu._bias_gelu_forward_kernel, fused_bias_gelu._bias_gelu_backward_kernel,
    fused_rope._rope_forward_kernel, fused_rope._rope_backward_kernel,
    fused_swiglu._swiglu_forward_kernel, fused_swiglu._swiglu_backward_kernel,
]

def signature(kernel):
    types = {}
    for param in kernel.params:
        name = param.name
        if param.is_constexpr:
            types[name] = "constexpr"
        elif name == "target_ptr":
            types[name] = "*i64"
        elif name.endswith("_ptr"):
            types[name] = "*fp32" if name in FP32_POINTERS else "*bf16"
        elif name in ("eps", "label_smoothing", "softcap", "z_loss"):
            types[name] = "fp32"
        else:
            types[name] = "i64" if name.endswith("row_stride") else "i32"
    return types

for kernel in KERNELS:
    types = signature(kernel)
    for flags in (True, False):
        constexprs = {p.name: BLOCKS.get(p.name, flags) for p in kernel.params if p.is_constexpr}
        compiled = triton.compile(ASTSource(kernel, types, constexprs), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 8})
        assert ".entry" in compiled.asm["ptx"], kernel.__name__
print("ok")
"""


def test_every_kernel_compiles_for_a_gpu_with_the_triton_compiler():
    result = run_python("-c", CHILD, timeout=300, check=False, TRITON_INTERPRET="0")
    if "SKIP" in result.stderr:
        pytest.skip(result.stderr.strip().splitlines()[-1])
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr


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
