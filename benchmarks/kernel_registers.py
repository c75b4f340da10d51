"""Registers a thread, spills and programs per multiprocessor of the norm backward's launch plans (tiles, and the
row loop they replaced), from Triton's own compiler and ptxas for sm_90 (H100, H200): no GPU needed.

A memory-bound kernel runs at the memory's speed only with enough bytes on their way per multiprocessor; how many of
its programs fit there at once is set by the registers each thread takes (65536 per multiprocessor, allocated per
warp in units of 256), and a program that loads nothing ahead adds nothing while it reduces. This is the CPU proxy
for the norm backward's design (issue 40): it says what fits, not how fast it runs, which only a GPU says
(``benchmarks/kernels.py``, the "fabriclite" and "fabriclite, row loop" columns).

The kernels are compiled as Triton's JIT compiles them for these shapes: unit column strides as constants, pointers,
widths and row strides divisible by 16, bf16 activations and an fp32 weight and statistics.

Usage: ``python benchmarks/kernel_registers.py [--widths 768 4096 8192]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions: read when the kernels are decorated, at import

REGISTERS_PER_MULTIPROCESSOR = 65536
MAX_WARPS_PER_MULTIPROCESSOR = 64
# name: (RMS, HAS_DSUM, HAS_BIAS), all with a weight
FORMS = {
    "rms_norm": (True, False, False),
    "add_rms_norm": (True, True, False),
    "layer_norm": (False, False, True),
    "add_layer_norm": (False, True, True),
}
SPECIALIZED = ("n_cols", "n_rows", "x_row_stride", "dy_row_stride", "dsum_row_stride")  # divisible by 16 here
FP32_POINTERS = ("weight_ptr", "stats_ptr", "partials_ptr")


def cuobjdump() -> Path:
    import triton

    return Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def registers(kernel, constexprs: dict, warps: int) -> tuple[int, int]:
    """(registers a thread, stack bytes a thread: spills) of ``kernel`` compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attributes = {}, dict(constexprs), {}
    for index, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
        elif name.endswith("col_stride"):  # 1 at these shapes: the JIT makes it a constant
            signature[name], constants[name] = "constexpr", 1
        elif name.endswith("_ptr"):
            signature[name] = "*fp32" if name in FP32_POINTERS else "*bf16"
            attributes[(index,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "i32"
            if name in SPECIALIZED:
                attributes[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(kernel, signature, constants, attributes),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": warps},
    )
    with tempfile.TemporaryDirectory() as folder:
        cubin = Path(folder) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [str(cuobjdump()), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    line = next(line for line in usage.splitlines() if "REG:" in line)
    return int(line.split("REG:")[1].split()[0]), int(line.split("STACK:")[1].split()[0])


def programs_that_fit(registers_per_thread: int, warps: int) -> int:
    """Programs of ``warps`` warps one sm_90 multiprocessor runs at once, as far as registers and warps allow."""
    per_warp = -(-registers_per_thread * 32 // 256) * 256
    warps_by_registers = REGISTERS_PER_MULTIPROCESSOR // per_warp
    return min(warps_by_registers, MAX_WARPS_PER_MULTIPROCESSOR) // warps


def rows(widths: list[int]) -> list[str]:
    """The markdown table's rows: one per width, design and form."""
    from fabriclite.kernels import _norm

    lines = []
    for width in widths:
        for row_loop in (False, True):
            block, tile_rows, warps, prefetch, launched = _norm._backward_sizes(width, row_loop)
            design = "row loop" if row_loop else "tiles"
            for form, (rms, dsum, bias) in FORMS.items():
                constexprs = {"RMS": rms, "HAS_DSUM": dsum, "HAS_WEIGHT": True, "HAS_BIAS": bias, "BLOCK": block,
                              "ROWS": tile_rows, "PREFETCH": prefetch}  # fmt: skip
                used, spilled = registers(_norm._norm_backward_kernel, constexprs, warps)
                fit = programs_that_fit(used, warps)
                lines.append(
                    f"| {width} | {design} | {form} | {tile_rows} x {block} | {warps} | {prefetch} | {used} | "
                    f"{spilled} | {min(fit, launched)} of {launched} launched ({fit * warps} warps fit) |"
                )
                print(lines[-1], flush=True)
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widths", nargs="+", type=int, default=[768, 4096, 8192])
    args = parser.parse_args()
    try:
        import triton.backends.nvidia  # noqa: F401 - the compiler for sm_90
    except ImportError as error:
        print(f"this triton has no NVIDIA backend to compile with ({error})")
        return 0
    if not cuobjdump().exists():
        print(f"this triton ships no cuobjdump ({cuobjdump()}): no register counts")
        return 0
    print("## the norm backward's register use on sm_90 (Triton's ptxas, no GPU), bf16 activations")
    print("")
    print(
        "| width | design | op | tile | warps | loads ahead | registers | spill bytes | programs per multiprocessor |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows(args.widths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
