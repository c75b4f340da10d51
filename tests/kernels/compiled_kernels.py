"""Compiles every launch of every fabriclite Triton kernel for a GPU (sm_90, an H100/H200) with Triton's own compiler,
with the argument types of both ways a kernel is launched, no GPU needed.

Which launches: each op's public function is called forward and backward on CPU tensors over the options that
change a kernel's compile-time flags (reductions, label smoothing, softcap, z-loss, residuals, weights and biases,
the norm backward's tiles and row loop, narrow and wide rows, both linear cross-entropy designs, dtypes), with the
kernels compiled (``TRITON_INTERPRET=0``, set here before triton is imported) and the launch itself recorded
instead of run (the one thing a machine without a GPU cannot do). Each distinct launch (kernel, argument types,
compile-time values, warps) is then compiled twice:

- ``eager``: the types Triton's JIT gives a direct launch (``kernel[grid](...)``): a Python float is fp32, an int
  i32 (i64 beyond 32 bits) or, equal to 1, a compile-time 1;
- ``inductor``: the types Inductor gives a user-defined Triton kernel inside ``torch.compile`` (``signature_of`` in
  torch/_inductor/codegen/triton_utils.py): a Python float is fp64 (``_use_fp64_for_unbacked_floats``, on CUDA), an
  int a symbolic size under dynamic shapes, i64.

A compile that fails prints ``FAIL <flavor> <kernel> <constexprs>: <error>``; a kernel that computes in fp64 (an
fp64 argument used without casting it to fp32: slow on a GPU, and a loop-carried variable that changes type fails to
compile) prints ``FP64 <flavor> <kernel> <constexprs>: <instructions>``; the last line is ``compiled <n> launches of
<k> kernels``. Usage: ``python tests/kernels/compiled_kernels.py``.
"""

import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402

# One ptxas per launch at a time on a small machine; the launches compile in separate processes.
WORKERS = max(1, min(4, os.cpu_count() or 1))

_POINTER_TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.int64: "*i64",
                  torch.int32: "*i32", torch.bool: "*i1"}  # fmt: skip


def _record_launches() -> list:
    """Runs every op's host code with the launches recorded: (kernel name, argument types by parameter, compile-time
    values, warps, whether it is a float argument), one entry per distinct launch."""
    from fabriclite.kernels import (
        _linear_cross_entropy_kernels,
        _norm,
        fused_bias_gelu,
        fused_cross_entropy,
        fused_linear_cross_entropy,
        fused_rope,
        fused_swiglu,
    )

    launches = {}

    def record(kernel, grid, *args, **meta):
        params = kernel.params
        values = dict(zip([p.name for p in params], args))
        values.update(meta)
        warps = values.pop("num_warps", 4)
        kinds, constexprs = {}, {}
        for param in params:
            value = values[param.name]
            if param.is_constexpr:
                constexprs[param.name] = value
            elif isinstance(value, torch.Tensor):
                kinds[param.name] = _POINTER_TYPES[value.dtype]
            elif isinstance(value, bool):
                kinds[param.name] = "i1"
            elif isinstance(value, int):
                kinds[param.name] = "int1" if value == 1 else "int" if -(2**31) <= value < 2**31 else "int64"
            elif isinstance(value, float):
                kinds[param.name] = "float"
            else:
                raise TypeError(f"{kernel.__name__}: {param.name}={value!r} is of no type this script knows")
        key = (kernel.__name__, tuple(sorted(kinds.items())), tuple(sorted(constexprs.items())), warps)
        launches[key] = (kernel.__module__, kernel.__name__, kinds, constexprs, warps)

    modules = (_linear_cross_entropy_kernels, _norm, fused_bias_gelu, fused_cross_entropy, fused_rope, fused_swiglu)
    for module in modules:
        module.launch = record
    # Every option in bf16; fp32 and fp16 (other loads and stores, the same flags) with one set of options each.
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        _run_every_op(dtype, every=dtype == torch.bfloat16, lce_module=fused_linear_cross_entropy, norm_module=_norm)
    return list(launches.values())


def _run_every_op(dtype: torch.dtype, every: bool, lce_module, norm_module) -> None:
    """Each op forward and backward over the options that set the kernels' compile-time flags (``every``), or over
    one set with every option on."""
    from fabriclite import kernels as ops

    def leaf(*shape):
        return torch.randn(*shape, dtype=dtype, requires_grad=True)

    def backward(*outputs):
        outputs = [o for o in outputs if o.requires_grad]
        torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])

    def options(all_of, one):
        return all_of if every else (one,)

    target = torch.tensor([0, 5, -100, 3])
    for reduction in options(("mean", "sum", "none"), "mean"):
        for smoothing in options((0.0, 0.1), 0.1):
            backward(ops.cross_entropy(leaf(4, 6), target, label_smoothing=smoothing, reduction=reduction))
    # Tiles, the row loop, rows too wide for tiles.
    for n, row_loop in options(((64, False), (64, True), (16384, False)), (64, False)):
        norm_module.ROW_LOOP_BACKWARD = row_loop
        try:
            backward(ops.layer_norm(leaf(3, n), (n,), leaf(n), leaf(n)))
            backward(ops.layer_norm(leaf(3, n), (n,)))
            backward(ops.rms_norm(leaf(3, n), leaf(n), 1e-6))
            backward(ops.rms_norm(leaf(3, n), None))
            backward(*ops.add_layer_norm(leaf(3, n), leaf(3, n), leaf(n), leaf(n)))
            backward(*ops.add_rms_norm(leaf(3, n), leaf(3, n), leaf(n)))
            backward(ops.add_rms_norm(leaf(3, n), leaf(3, n), None)[0])
        finally:
            norm_module.ROW_LOOP_BACKWARD = False
    for approximate in options(("none", "tanh"), "tanh"):
        backward(ops.bias_gelu(leaf(3, 40), leaf(40), approximate))
    backward(ops.swiglu(leaf(3, 40), leaf(3, 40)))
    for table in options(((5, 8), (2, 5, 8)), (5, 8)):  # one cos and sin table for every sequence, or one each
        backward(
            *ops.rope(
                leaf(2, 5, 4, 8), leaf(2, 5, 2, 8), torch.randn(*table, dtype=dtype), torch.randn(*table, dtype=dtype)
            )
        )
    for rows_design in options((False, True), False):
        for reduction in options(("mean", "sum", "none"), "mean"):
            for smoothing, softcap, z_loss in options(((0.0, None, 0.0), (0.1, 30.0, 1e-4)), (0.1, 30.0, 1e-4)):
                # Chunks of 256 vocabulary columns or 2 rows: several chunks, the first and last among them.
                lce_module.GRADIENT_IN_FORWARD, lce_module.CHUNK_COLS, lce_module.CHUNK_ROWS = rows_design, 256, 2
                try:
                    loss = ops.linear_cross_entropy(
                        leaf(4, 16), leaf(600, 16), target, leaf(600), label_smoothing=smoothing,
                        reduction=reduction, softcap=softcap, z_loss=z_loss,
                    )  # fmt: skip
                    backward(loss)
                finally:
                    lce_module.GRADIENT_IN_FORWARD, lce_module.CHUNK_COLS, lce_module.CHUNK_ROWS = False, None, None


def _signature(kinds: dict, constexprs: dict, flavor: str) -> tuple[dict, dict]:
    """(signature, compile-time values) of a launch as ``flavor`` ("eager" or "inductor") types it."""
    signature, constants = {}, dict(constexprs)
    for name, kind in kinds.items():
        if kind == "float":
            signature[name] = "fp64" if flavor == "inductor" else "fp32"
        elif kind == "int1" and flavor == "eager":
            signature[name] = "constexpr"  # Triton's JIT specializes an int equal to 1
            constants[name] = 1
        elif kind.startswith("int"):
            signature[name] = "i64" if flavor == "inductor" or kind == "int64" else "i32"
        else:
            signature[name] = kind
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constants


# PTX instructions on fp64 values that are not the argument's load and its one conversion to fp32.
_FP64 = re.compile(r"^\s*(?!ld\.param|cvt\.rn\.f32\.f64|mov\.b64)[a-z][\w.]*\.f64\b.*$", re.MULTILINE)


def _compile(launch: tuple) -> list[str]:
    """Problems of one launch in both flavors: failed compiles and fp64 arithmetic, one line each."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    module, name, kinds, constexprs, warps = launch
    kernel = getattr(importlib.import_module(module), name)
    problems = []
    for flavor in ("eager", "inductor"):
        signature, constants = _signature(kinds, constexprs, flavor)
        where = f"{flavor} {name} {sorted(constexprs.items())} warps={warps}"
        try:
            compiled = triton.compile(
                ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}
            )
        except Exception as exc:  # noqa: BLE001 - every launch's outcome is reported
            problems.append(f"FAIL {where}: {' '.join(str(exc).split())[-400:]}")
            continue
        fp64 = _FP64.findall(compiled.asm["ptx"])
        if fp64:
            problems.append(f"FP64 {where}: {'; '.join(line.strip() for line in fp64[:3])}")
    return problems


def main() -> int:
    launches = _record_launches()
    with ProcessPoolExecutor(WORKERS) as pool:
        for problems in pool.map(_compile, launches):
            for line in problems:
                print(line, flush=True)
    kernels = {launch[1] for launch in launches}
    print(f"compiled {len(launches)} launches of {len(kernels)} kernels: {','.join(sorted(kernels))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
