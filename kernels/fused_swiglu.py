"""SwiGLU's gate: ``silu(a) * b``, the gated MLP of Llama-style models (``down(silu(gate(x)) * up(x))``).

Both kernels work on (BLOCK_M, BLOCK_N) tiles of the (rows, N) views of a and b, which may have their own row
strides: a and b are often the two halves of one fused gate-and-up projection (``h.chunk(2, dim=-1)``), and are
read where they lie. The forward reads a and b once and writes y; ``silu(a)`` is never stored, the backward
recomputes it from the saved inputs and writes ``da = dy * b * silu'(a)`` and ``db = dy * silu(a)`` with
``silu'(a) = sigmoid(a) * (1 + a * (1 - sigmoid(a)))``.
"""

import torch
import triton
import triton.language as tl

from fabriclite.kernels._common import cdiv, check_dtypes, launch, library_op, rows_and_strides, tile_blocks

# Tile shape: at most BLOCK_N_MAX columns, and about TILE elements per program.
BLOCK_N_MAX = 1024
TILE = 4096


@triton.jit
def _swiglu_forward_kernel(
    a_ptr,
    a_row_stride,
    b_ptr,
    b_row_stride,
    y_ptr,
    n_rows,
    n_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    a = tl.load(a_ptr + rows[:, None] * a_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None] * b_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b
    tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_backward_kernel(
    da_ptr,
    db_ptr,
    dy_ptr,
    dy_row_stride,
    dy_col_stride,
    a_ptr,
    a_row_stride,
    b_ptr,
    b_row_stride,
    n_rows,
    n_cols,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    a = tl.load(a_ptr + rows[:, None] * a_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + rows[:, None] * b_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    # dy may be an expanded gradient (strides 0), hence both strides.
    dy_offsets = rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride
    dy = tl.load(dy_ptr + dy_offsets, mask=mask, other=0.0).to(tl.float32)
    sigmoid = tl.sigmoid(a)
    silu = a * sigmoid
    da = dy * b * (sigmoid + silu * (1.0 - sigmoid))
    db = dy * silu
    out = rows[:, None] * n_cols + cols[None, :]
    tl.store(da_ptr + out, da.to(da_ptr.dtype.element_ty), mask=mask)
    tl.store(db_ptr + out, db.to(db_ptr.dtype.element_ty), mask=mask)


def _forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    y = torch.empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype), device=a.device)
    if a.numel() == 0:
        return y
    n_cols = a.shape[-1] if a.dim() else 1
    n_rows = a.numel() // n_cols
    a_rows, a_stride, _ = rows_and_strides(a, n_cols, unit_col_stride=True)
    b_rows, b_stride, _ = rows_and_strides(b, n_cols, unit_col_stride=True)
    block_m, block_n, warps = tile_blocks(n_cols, TILE, BLOCK_N_MAX)
    launch(
        _swiglu_forward_kernel,
        (cdiv(n_rows, block_m), cdiv(n_cols, block_n)),
        a_rows,
        a_stride,
        b_rows,
        b_stride,
        y,
        n_rows,
        n_cols,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    return y


def _backward(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    da = torch.empty(a.shape, dtype=a.dtype, device=a.device)
    db = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    if a.numel() == 0:
        return da, db
    n_cols = a.shape[-1] if a.dim() else 1
    n_rows = a.numel() // n_cols
    a_rows, a_stride, _ = rows_and_strides(a, n_cols, unit_col_stride=True)
    b_rows, b_stride, _ = rows_and_strides(b, n_cols, unit_col_stride=True)
    dy_rows, dy_row_stride, dy_col_stride = rows_and_strides(dy, n_cols)
    block_m, block_n, warps = tile_blocks(n_cols, TILE, BLOCK_N_MAX)
    launch(
        _swiglu_backward_kernel,
        (cdiv(n_rows, block_m), cdiv(n_cols, block_n)),
        da,
        db,
        dy_rows,
        dy_row_stride,
        dy_col_stride,
        a_rows,
        a_stride,
        b_rows,
        b_stride,
        n_rows,
        n_cols,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=warps,
    )
    return da, db


# ---------------------------------------------------------------------- eager: an autograd Function
class _SwigluFunction(torch.autograd.Function):
    """Eager calls: the kernels launched directly, without the custom op's dispatch."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _forward(a, b)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        return _backward(dy, *ctx.saved_tensors)


# ---------------------------------------------------------------------- traced: torch.library registration
def _swiglu_op_fake(a, b):
    return a.new_empty(a.shape, dtype=torch.promote_types(a.dtype, b.dtype))


@library_op("fabriclite::swiglu", fake=_swiglu_op_fake)
def _swiglu_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _forward(a, b)


def _swiglu_backward_op_fake(dy, a, b):
    return a.new_empty(a.shape), b.new_empty(b.shape)


@library_op("fabriclite::swiglu_backward", fake=_swiglu_backward_op_fake)
def _swiglu_backward_op(dy: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (da, db)."""
    return _backward(dy, a, b)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward_formula(ctx, dy):
    a, b = ctx.saved_tensors
    return torch.ops.fabriclite.swiglu_backward(dy, a, b)


_swiglu_op.register_autograd(_backward_formula, setup_context=_setup_context)


# ---------------------------------------------------------------------- public API
def swiglu(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``F.silu(a) * b`` in one kernel, for a and b of one shape (the gate and up projections of a gated MLP).

    Usage: ``h = down(swiglu(gate(x), up(x)))``, or ``swiglu(*gate_up(x).chunk(2, dim=-1))``.
    """
    if a.shape != b.shape:
        raise ValueError(
            f"swiglu needs a and b of one shape (no broadcasting); got {tuple(a.shape)} and {tuple(b.shape)}."
        )
    check_dtypes("swiglu", "torch.nn.functional.silu(a) * b", a, b)
    if torch.compiler.is_compiling():
        return torch.ops.fabriclite.swiglu(a, b)
    return _SwigluFunction.apply(a, b)


__all__ = ["swiglu"]
