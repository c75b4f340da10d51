"""Bias add fused with GELU: ``F.gelu(x + bias, approximate=...)`` for a bias over the last dimension.

Both kernels work on (BLOCK_M, BLOCK_N) tiles of the (rows, N) view of x. The forward reads x and the bias once and
writes y; the pre-activation ``x + bias`` is never stored, the backward recomputes it. The backward writes
``dx = dy * gelu'(x + bias)`` and, per tile row, an fp32 partial column sum of dx; the host adds up those partials
into the bias gradient.

The tanh form computes ``tanh(u)`` as ``2 * sigmoid(2u) - 1``: same value, and it runs in Triton's interpreter,
where the libdevice tanh does not.
"""

import torch
import triton
import triton.language as tl

from fabriclite.kernels._common import cast, cdiv, check_dtypes, launch, library_op, rows_and_strides, tile_blocks

# Tile shape: at most BLOCK_N_MAX columns, and about TILE elements per program.
BLOCK_N_MAX = 1024
TILE = 4096
_APPROXIMATIONS = ("none", "tanh")


@triton.jit
def _gelu_and_derivative(z, TANH: tl.constexpr):
    if TANH:
        # tanh(u) with u = sqrt(2 / pi) * (z + 0.044715 z^3)
        t = 2.0 * tl.sigmoid(2.0 * 0.7978845608028654 * (z + 0.044715 * z * z * z)) - 1.0
        gelu = 0.5 * z * (1.0 + t)
        derivative = 0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * z * z)
    else:
        cdf = 0.5 * (1.0 + tl.erf(z * 0.7071067811865476))  # Phi(z)
        gelu = z * cdf
        derivative = cdf + z * 0.3989422804014327 * tl.exp(-0.5 * z * z)  # Phi(z) + z * phi(z)
    return gelu, derivative


@triton.jit
def _bias_gelu_forward_kernel(
    x_ptr,
    x_row_stride,
    bias_ptr,
    y_ptr,
    n_rows,
    n_cols,
    TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    y, _ = _gelu_and_derivative(x + bias[None, :], TANH)
    tl.store(y_ptr + rows[:, None] * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_backward_kernel(
    dx_ptr,
    dy_ptr,
    dy_row_stride,
    dy_col_stride,
    x_ptr,
    x_row_stride,
    bias_ptr,
    dbias_partial_ptr,
    n_rows,
    n_cols,
    TANH: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    tile_row = tl.program_id(0).to(tl.int64)
    rows = tile_row * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < n_cols
    mask = (rows < n_rows)[:, None] & col_mask[None, :]
    x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    # dy may be an expanded gradient (strides 0), hence both strides.
    dy_offsets = rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride
    dy = tl.load(dy_ptr + dy_offsets, mask=mask, other=0.0).to(tl.float32)
    _, derivative = _gelu_and_derivative(x + bias[None, :], TANH)
    dx = tl.where(mask, dy * derivative, 0.0)
    tl.store(dx_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dbias_partial_ptr + tile_row * n_cols + cols, tl.sum(dx, axis=0), mask=col_mask)


def _forward(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    n_cols = bias.numel()
    n_rows = x.numel() // n_cols
    x_rows, x_stride, _ = rows_and_strides(x, n_cols, unit_col_stride=True)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, bias.dtype), device=x.device)
    block_m, block_n, warps = tile_blocks(n_cols, TILE, BLOCK_N_MAX)
    if n_rows > 0:
        launch(
            _bias_gelu_forward_kernel,
            (cdiv(n_rows, block_m), cdiv(n_cols, block_n)),
            x_rows,
            x_stride,
            bias if bias.is_contiguous() else bias.contiguous(),
            y,
            n_rows,
            n_cols,
            TANH=approximate == "tanh",
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
        )
    return y


def _backward(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    n_cols = bias.numel()
    n_rows = x.numel() // n_cols
    x_rows, x_stride, _ = rows_and_strides(x, n_cols, unit_col_stride=True)
    dy_rows, dy_row_stride, dy_col_stride = rows_and_strides(dy, n_cols)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    block_m, block_n, warps = tile_blocks(n_cols, TILE, BLOCK_N_MAX)
    tile_rows = cdiv(n_rows, block_m)
    dbias = torch.empty((tile_rows, n_cols), dtype=torch.float32, device=x.device)
    if n_rows > 0:
        launch(
            _bias_gelu_backward_kernel,
            (tile_rows, cdiv(n_cols, block_n)),
            dx,
            dy_rows,
            dy_row_stride,
            dy_col_stride,
            x_rows,
            x_stride,
            bias if bias.is_contiguous() else bias.contiguous(),
            dbias,
            n_rows,
            n_cols,
            TANH=approximate == "tanh",
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=warps,
        )
    return dx, cast(dbias.sum(0), bias.dtype)  # the bias is 1-D: the sum has its shape


# ---------------------------------------------------------------------- eager: an autograd Function
class _BiasGeluFunction(torch.autograd.Function):
    """Eager calls: the kernels launched directly, without the custom op's dispatch."""

    @staticmethod
    def forward(ctx, x, bias, approximate):
        ctx.save_for_backward(x, bias)
        ctx.approximate = approximate
        return _forward(x, bias, approximate)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        return *_backward(dy, x, bias, ctx.approximate), None


# ---------------------------------------------------------------------- traced: torch.library registration
def _bias_gelu_op_fake(x, bias, approximate):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, bias.dtype))


@library_op("fabriclite::bias_gelu", fake=_bias_gelu_op_fake)
def _bias_gelu_op(x: torch.Tensor, bias: torch.Tensor, approximate: str) -> torch.Tensor:
    return _forward(x, bias, approximate)


def _bias_gelu_backward_op_fake(dy, x, bias, approximate):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(
        bias, memory_format=torch.contiguous_format
    )


@library_op("fabriclite::bias_gelu_backward", fake=_bias_gelu_backward_op_fake)
def _bias_gelu_backward_op(
    dy: torch.Tensor, x: torch.Tensor, bias: torch.Tensor, approximate: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx, dbias)."""
    return _backward(dy, x, bias, approximate)


def _setup_context(ctx, inputs, output) -> None:
    x, bias, approximate = inputs
    ctx.save_for_backward(x, bias)
    ctx.approximate = approximate


def _backward_formula(ctx, dy):
    x, bias = ctx.saved_tensors
    dx, dbias = torch.ops.fabriclite.bias_gelu_backward(dy, x, bias, ctx.approximate)
    return dx, dbias, None


_bias_gelu_op.register_autograd(_backward_formula, setup_context=_setup_context)


# ---------------------------------------------------------------------- public API
def bias_gelu(x: torch.Tensor, bias: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """``F.gelu(x + bias, approximate=approximate)`` in one kernel, for a bias over x's last dimension.

    Usage: ``h = bias_gelu(x @ w1.T, b1, approximate="tanh")``.
    """
    if approximate not in _APPROXIMATIONS:
        raise ValueError(f"approximate={approximate!r} is not supported; use one of {_APPROXIMATIONS}.")
    if bias.dim() != 1 or x.dim() == 0 or x.shape[-1] != bias.shape[0]:
        raise ValueError(
            f"bias_gelu needs a 1-D bias as long as x's last dimension; got x {tuple(x.shape)} and bias "
            f"{tuple(bias.shape)}."
        )
    check_dtypes("bias_gelu", "torch.nn.functional.gelu(x + bias)", x, bias)
    if torch.compiler.is_compiling():
        return torch.ops.fabriclite.bias_gelu(x, bias, approximate)
    return _BiasGeluFunction.apply(x, bias, approximate)


__all__ = ["bias_gelu"]
