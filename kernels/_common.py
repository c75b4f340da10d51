"""What the op files share: launching a kernel (counted, with a clear error off the GPU), the dtypes the kernels
take, viewing a tensor as rows, and the launch sizes. Importing this imports triton; ``fabriclite.kernels`` imports
it only when an op is used.
"""

from __future__ import annotations

import functools
import os
from collections import Counter
from typing import Any, Callable, Optional

import torch
import triton

from fabriclite._versions import traced_triton_launch

# Kernel launches by kernel name. Tests read it to prove a Triton kernel ran (there is no torch fallback to hide
# behind); it costs one dict update per launch.
LAUNCHES: Counter[str] = Counter()

# Triton decides this when a kernel is decorated, i.e. when the op files are imported.
INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")

# A row lives in one block in the norm kernels; wider rows than this do not fit the registers of one program.
MAX_ROW_BLOCK = 65536


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """Run ``kernel[grid](*args, **meta)``, counted in ``LAUNCHES``.

    Usage: ``launch(_my_forward_kernel, (n_rows,), x, y, n_cols, BLOCK=1024)``.
    """
    LAUNCHES[kernel.__name__] += 1
    tensor = args[0]
    if traced_triton_launch(tensor):  # torch.compile tracing a library op: the launch becomes a node of its graph
        torch.library.wrap_triton(kernel)[grid](*args, **meta)
        return
    if tensor.device.type != "cuda" and not INTERPRET:
        raise RuntimeError(
            f"fabriclite.kernels run Triton kernels on CUDA tensors; got a tensor on {tensor.device}. Move the "
            "tensors to a CUDA device, use the torch op instead, or (to test on a CPU) set TRITON_INTERPRET=1 "
            "before triton is imported."
        )
    kernel[grid](*args, **meta)


# Library ops (what traced code calls): ``torch.library.triton_op`` where the kernels are compiled, so that
# torch.compile sees the Triton kernels inside each op and Inductor launches them from its own code, with no Python
# dispatch per call; a ``custom_op`` under Triton's interpreter (its kernels cannot be traced), which runs the op's
# Python body. Decided once, at import, as the interpreter itself is.
TRITON_OPS = not INTERPRET


def library_op(name: str, fake: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """Decorator registering ``fn`` as the library op ``name`` (a ``triton_op`` or a ``custom_op``, see
    ``TRITON_OPS``), with ``fake`` computing its outputs' shapes for a custom op (a triton op traces ``fn`` itself).

    Usage: ``@library_op("fabriclite::rope", fake=_rope_fake)`` over ``def _rope_op(q: torch.Tensor, ...) -> ...``.
    """

    def register(fn: Callable[..., Any]) -> Any:
        if TRITON_OPS:
            return torch.library.triton_op(name, fn, mutates_args=())
        op = torch.library.custom_op(name, fn, mutates_args=())
        op.register_fake(fake)
        return op

    return register


# The kernels load these, compute in fp32 and store in the tensor's dtype. float64 would come back rounded to fp32
# precision in silence, so it is refused rather than computed.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_dtypes(op: str, torch_op: str, *tensors: Optional[torch.Tensor]) -> None:
    """Raise a ``TypeError`` naming the dtype when one of ``tensors`` (None ones skipped) is not in
    ``SUPPORTED_DTYPES``.

    Usage: ``check_dtypes("rms_norm", "torch.nn.functional.rms_norm", x, weight)``.
    """
    for tensor in tensors:
        if tensor is not None and tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"fabriclite.kernels.{op} got a {tensor.dtype} tensor; its Triton kernels compute in fp32 and take "
                f"float32, bfloat16 and float16 only. Cast the tensors to one of those, or use {torch_op} (for a "
                "float64 model: leave swap_modules and Fabric(kernels=True) off)."
            )


def as_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """``t`` as a (rows, n_cols) tensor, a view where the strides allow it (expanded gradients stay unexpanded)."""
    try:
        return t.view(-1, n_cols)
    except RuntimeError:
        return t.reshape(-1, n_cols)


def contiguous_rows(t: torch.Tensor, n_cols: int) -> torch.Tensor:
    """``t`` as a (rows, n_cols) tensor whose rows are contiguous: what the kernels that read a row as a block need."""
    rows = as_rows(t, n_cols)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def rows_and_strides(t: torch.Tensor, n_cols: int, unit_col_stride: bool = False) -> tuple[torch.Tensor, int, int]:
    """``t`` seen as rows of ``n_cols``: (tensor, row stride, column stride), ``t`` itself when it is contiguous (a
    view would cost a dispatch per call); ``unit_col_stride`` copies rows whose elements are not adjacent.

    Usage: ``dy, dy_row_stride, dy_col_stride = rows_and_strides(dy, n_cols)``.
    """
    if t.is_contiguous():
        return t, n_cols, 1
    rows = contiguous_rows(t, n_cols) if unit_col_stride else as_rows(t, n_cols)
    return rows, rows.stride(0), rows.stride(1)


def cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)`` without the dispatch when it already is."""
    return t if t.dtype == dtype else t.to(dtype)


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for the host (``triton.cdiv`` is a jit function: microseconds per call outside a kernel)."""
    return -(-a // b)


def row_block(n_cols: int) -> int:
    """The block that holds one whole row, and an error naming the limit when it cannot."""
    block = triton.next_power_of_2(n_cols)
    if block > MAX_ROW_BLOCK:
        raise ValueError(
            f"fabriclite.kernels normalizes rows of at most {MAX_ROW_BLOCK} elements in one block; got {n_cols}. "
            "Use the torch op for rows this wide."
        )
    return block


def num_warps(block: int) -> int:
    """Warps for a program that works on ``block`` elements at a time: enough that each thread holds a few dozen."""
    if block >= 32768:
        return 32
    if block >= 8192:
        return 16
    if block >= 2048:
        return 8
    return 4


def launch_sizes(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator: ``fn`` (launch sizes from widths) worked out once per width, as ``functools.lru_cache`` does, and
    also for a symbolic width.

    Under ``torch.compile`` with dynamic shapes (``dynamic=True``, a dimension Dynamo made dynamic after it changed,
    ``opcheck``'s AOT test) a library op's body runs with ``torch.SymInt`` widths, which cannot be hashed into a
    cache, and a kernel's block sizes must be constants of the graph. ``fn`` uses its integer arguments only through
    their next power of 2, so a symbolic one is replaced by the power of 2 at or above it, found by comparisons:
    Dynamo records them as guards on the width's range, the width stays symbolic in the graph, and a width past the
    next power of 2 compiles once more. A plain call costs what the cache costs (the symbolic case is the cache's
    own ``TypeError``).

    Usage: ``@launch_sizes`` over ``def _block(n_cols: int) -> tuple[int, int]``.
    """
    cached = functools.lru_cache(maxsize=None)(fn)

    @functools.wraps(fn)
    def sizes(*args: Any) -> Any:
        try:
            return cached(*args)
        except TypeError:
            if not any(isinstance(arg, torch.SymInt) for arg in args):
                raise
        return cached(*(_power_of_2_at_least(arg) if isinstance(arg, torch.SymInt) else arg for arg in args))

    return sizes


def _power_of_2_at_least(n: torch.SymInt) -> int:
    block = 1
    while n > block:  # a guard on n's range, not a value read from it
        block *= 2
    return block


@launch_sizes
def tile_blocks(n_cols: int, tile: int, block_n_max: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of an elementwise kernel over (rows, n_cols) tiles of about ``tile`` elements,
    worked out once per width.

    Usage: ``block_m, block_n, warps = tile_blocks(n_cols, TILE, BLOCK_N_MAX)``.
    """
    block_n = min(triton.next_power_of_2(n_cols), block_n_max)
    block_m = max(1, tile // block_n)
    return block_m, block_n, num_warps(block_m * block_n)


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# Programs per multiprocessor in a backward that sums weight gradients: one program walks its rows one after the
# other, so a multiprocessor running a single one waits on every load; several overlap one's loads with another's
# arithmetic. Each adds an fp32 row of partial sums (programs x n_cols in all, small beside the activations).
PROGRAMS_PER_MULTIPROCESSOR = 4


def reduction_programs(device: torch.device, n_rows: int, per_multiprocessor: int = PROGRAMS_PER_MULTIPROCESSOR) -> int:
    """How many programs share the rows of a backward that also sums weight gradients (each keeps an fp32 partial
    sum of its rows): ``per_multiprocessor`` per multiprocessor on a GPU, a few in all in the interpreter where
    programs run one by one."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return max(1, min(n_rows, per_multiprocessor * _multiprocessors(index)))
    return max(1, min(n_rows, 4))


# GPU classes: one measurement stands for the GPUs of one architecture and memory system.
DEVICE_CLASSES = {"H100": "H100/H200", "H200": "H100/H200"}


def device_class(name: str) -> str | None:
    """The class ``MEASURED_WINS`` knows a GPU by, from ``torch.cuda.get_device_name()``; None for a GPU of no class.

    Usage: ``device_class("NVIDIA H200") == "H100/H200"``.
    """
    return next((cls for key, cls in DEVICE_CLASSES.items() if key in name.split()), None)


# The norm backward's two designs (kernels/_norm.py): tiles of rows with the next one loaded ahead, or the row loop
# before them. (GPU class, op) -> the widths at which the row loop's forward and backward took less GPU time than the
# tiles' (gpu_suite.py's kernels section); the tiles everywhere else. One H200, 2026-11-27: the tiles faster in 10 of
# 12 rows (op, shape, wall or GPU time; up to 1.43x), the row loop in RMS norm's GPU time at 16384x4096 (0.202 ms
# against 0.216) and in layer norm's wall time at 25216x768 (its GPU time 1.15x faster in tiles: host time).
ROW_LOOP_WINS: dict[tuple[str, str], frozenset[int]] = {("H100/H200", "rms_norm"): frozenset({4096})}


def row_loop_measured_faster(device: torch.device, op: str, width: Any) -> bool:
    """Whether the norm backward ``op`` ("rms_norm", "layer_norm") at ``width`` takes the row loop on ``device``
    (``ROW_LOOP_WINS``). A symbolic width (``torch.SymInt``, under compile) is compared, never hashed: Dynamo keeps
    the comparison as a guard.

    Usage: ``row_loop_measured_faster(x.device, "rms_norm", 4096)``.
    """
    return any(width == measured for measured in _row_loop_widths(device, op))


@functools.lru_cache(maxsize=None)
def _row_loop_widths(device: torch.device, op: str) -> frozenset[int]:
    cls = device_class(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    return ROW_LOOP_WINS.get((cls, op), frozenset())
