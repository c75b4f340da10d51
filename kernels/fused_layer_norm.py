"""Layer norm, alone or fused with the residual add in front of it (``add_layer_norm``).

Forward: one row per program, the whole row in one block; mean and rstd are computed in fp32 and saved (one fp32
each per row) for the backward. With a residual the kernel also writes ``x + residual``, the residual stream a
pre-norm transformer carries on: the sum leaves the registers once, instead of an add kernel writing it and a norm
kernel reading it back.

Backward: each program walks a contiguous range of rows, writes their input gradient, and keeps fp32 partial sums of
the weight and bias gradients in registers; the host adds up the per-program partials. ``add_layer_norm``'s
backward adds the gradient arriving at the sum output to the input gradient, and that total is the gradient of
both ``x`` and ``residual``.
"""

import math
from typing import Optional, Union

import torch
import triton
import triton.language as tl

from fabriclite.kernels._common import (
    as_rows,
    check_dtypes,
    contiguous_rows,
    launch,
    num_warps,
    reduction_programs,
    row_block,
)


@triton.jit
def _layer_norm_forward_kernel(
    x_ptr,
    x_row_stride,
    residual_ptr,
    residual_row_stride,
    sum_ptr,
    y_ptr,
    weight_ptr,
    bias_ptr,
    mean_ptr,
    rstd_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * n_cols + cols, x, mask=mask)
        # Normalize the sum as stored, so the backward (which reads it back) sees the same numbers.
        x = x.to(tl.float32)
    mean = tl.sum(x, axis=0) / n_cols
    centered = tl.where(mask, x - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    y = centered * rstd
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _layer_norm_backward_kernel(
    dx_ptr,
    dy_ptr,
    dy_row_stride,
    dy_col_stride,
    dsum_ptr,
    dsum_row_stride,
    dsum_col_stride,
    x_ptr,
    x_row_stride,
    weight_ptr,
    mean_ptr,
    rstd_ptr,
    dweight_partial_ptr,
    dbias_partial_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    HAS_DSUM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    program = tl.program_id(0).to(tl.int64)
    row_start = program * rows_per_program
    # Counting i from 0 and adding it to the int64 start keeps row int64 in the interpreter too, where a loop
    # variable from range(row_start, ...) is a Python int that becomes int32 in arithmetic.
    rows_here = tl.minimum(rows_per_program, n_rows - row_start)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dweight = tl.zeros((BLOCK,), dtype=tl.float32)
    dbias = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(0, rows_here):
        row = row_start + i
        # dy may be an expanded gradient (strides 0), hence both strides.
        dy = tl.load(dy_ptr + row * dy_row_stride + cols * dy_col_stride, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        mean = tl.load(mean_ptr + row)
        rstd = tl.load(rstd_ptr + row)
        x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        if HAS_WEIGHT:
            w_dy = dy * weight
        else:
            w_dy = dy
        # dx = rstd * (w_dy - mean(w_dy) - x_hat * mean(w_dy * x_hat))
        dx = (w_dy - tl.sum(w_dy, axis=0) / n_cols - x_hat * (tl.sum(w_dy * x_hat, axis=0) / n_cols)) * rstd
        if HAS_DSUM:
            dx += tl.load(dsum_ptr + row * dsum_row_stride + cols * dsum_col_stride, mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dweight += dy * x_hat
        if HAS_BIAS:
            dbias += dy
    if HAS_WEIGHT:
        tl.store(dweight_partial_ptr + program * n_cols + cols, dweight, mask=mask)
    if HAS_BIAS:
        tl.store(dbias_partial_ptr + program * n_cols + cols, dbias, mask=mask)


def _forward(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    n_cols: int,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Returns (y, x + residual or None, mean, rstd), y and the sum shaped like x, mean and rstd like x's rows."""
    x_rows = contiguous_rows(x, n_cols)
    n_rows = x_rows.shape[0]
    if residual is not None:
        residual_rows = contiguous_rows(residual, n_cols)
        summed = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    else:
        residual_rows, summed = x_rows, None
    y = torch.empty(x.shape, dtype=x.dtype if summed is None else summed.dtype, device=x.device)
    mean = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    weight = weight.contiguous() if weight is not None else None
    bias = bias.contiguous() if bias is not None else None
    block = row_block(n_cols)
    if n_rows > 0:
        launch(
            _layer_norm_forward_kernel,
            (n_rows,),
            x_rows,
            x_rows.stride(0),
            residual_rows,
            residual_rows.stride(0),
            y if summed is None else summed,
            y,
            x_rows if weight is None else weight,
            x_rows if bias is None else bias,
            mean,
            rstd,
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=num_warps(block),
        )
    return y, summed, mean, rstd


def _backward(
    dy: torch.Tensor,
    dsum: Optional[torch.Tensor],
    x: torch.Tensor,
    normalized_shape: list[int],
    weight: Optional[torch.Tensor],
    has_bias: bool,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight, dbias); the last two are empty when there is no weight or no bias."""
    n_cols = math.prod(normalized_shape)
    x_rows = contiguous_rows(x, n_cols)
    n_rows = x_rows.shape[0]
    dy_rows = as_rows(dy, n_cols)
    dsum_rows = as_rows(dsum, n_cols) if dsum is not None else dy_rows
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    weight = weight.contiguous() if weight is not None else None
    programs = reduction_programs(x.device, n_rows)
    partials = (programs, n_cols) if n_rows > 0 else (0, n_cols)
    dweight = torch.empty(partials if weight is not None else 0, dtype=torch.float32, device=x.device)
    dbias = torch.empty(partials if has_bias else 0, dtype=torch.float32, device=x.device)
    block = row_block(n_cols)
    if n_rows > 0:
        launch(
            _layer_norm_backward_kernel,
            (programs,),
            dx,
            dy_rows,
            dy_rows.stride(0),
            dy_rows.stride(1),
            dsum_rows,
            dsum_rows.stride(0),
            dsum_rows.stride(1),
            x_rows,
            x_rows.stride(0),
            x_rows if weight is None else weight,
            mean,
            rstd,
            dweight,
            dbias,
            n_rows,
            n_cols,
            triton.cdiv(n_rows, programs),
            HAS_DSUM=dsum is not None,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=has_bias,
            BLOCK=block,
            num_warps=num_warps(block),
        )
    if weight is not None:
        dweight = dweight.sum(0).to(weight.dtype).view(normalized_shape)
    if has_bias:
        dbias = dbias.sum(0).view(normalized_shape)
    return dx, dweight, dbias


def _row_stats_like(x: torch.Tensor, normalized_shape: list[int]) -> torch.Tensor:
    """An fp32 tensor shaped like x's leading (not normalized) dimensions: what mean and rstd look like."""
    return x.new_empty(x.shape[: x.dim() - len(normalized_shape)], dtype=torch.float32)


# ---------------------------------------------------------------------- torch.library registration
@torch.library.custom_op("fabriclite::layer_norm", mutates_args=())
def _layer_norm_op(
    x: torch.Tensor,
    normalized_shape: list[int],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, mean, rstd), like ``torch.native_layer_norm``."""
    y, _, mean, rstd = _forward(x, None, math.prod(normalized_shape), weight, bias, eps)
    leading = x.shape[: x.dim() - len(normalized_shape)]
    return y, mean.view(leading), rstd.view(leading)


@_layer_norm_op.register_fake
def _(x, normalized_shape, weight, bias, eps):
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    return y, _row_stats_like(x, normalized_shape), _row_stats_like(x, normalized_shape)


@torch.library.custom_op("fabriclite::add_layer_norm", mutates_args=())
def _add_layer_norm_op(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (layer_norm(x + residual), x + residual, mean, rstd), normalizing over the last dimension."""
    y, summed, mean, rstd = _forward(x, residual, x.shape[-1], weight, bias, eps)
    return y, summed, mean.view(x.shape[:-1]), rstd.view(x.shape[:-1])


@_add_layer_norm_op.register_fake
def _(x, residual, weight, bias, eps):
    dtype = torch.promote_types(x.dtype, residual.dtype)
    out = x.new_empty(x.shape, dtype=dtype)
    return out, torch.empty_like(out), _row_stats_like(x, [x.shape[-1]]), _row_stats_like(x, [x.shape[-1]])


@torch.library.custom_op("fabriclite::layer_norm_backward", mutates_args=())
def _layer_norm_backward_op(
    dy: torch.Tensor,
    dsum: Optional[torch.Tensor],
    x: torch.Tensor,
    normalized_shape: list[int],
    weight: Optional[torch.Tensor],
    has_bias: bool,
    mean: torch.Tensor,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight, dbias) where dx includes ``dsum``; dweight or dbias is empty when absent."""
    return _backward(dy, dsum, x, normalized_shape, weight, has_bias, mean, rstd)


@_layer_norm_backward_op.register_fake
def _(dy, dsum, x, normalized_shape, weight, has_bias, mean, rstd):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dweight = torch.empty_like(weight) if weight is not None else x.new_empty(0, dtype=torch.float32)
    dbias = x.new_empty(normalized_shape, dtype=torch.float32) if has_bias else x.new_empty(0, dtype=torch.float32)
    return dx, dweight, dbias


def _layer_norm_setup(ctx, inputs, output) -> None:
    x, normalized_shape, weight, bias, _ = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.normalized_shape = normalized_shape
    ctx.bias_dtype = bias.dtype if bias is not None else None
    ctx.mark_non_differentiable(mean, rstd)


def _layer_norm_backward(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    has_bias = ctx.bias_dtype is not None
    dx, dweight, dbias = torch.ops.fabriclite.layer_norm_backward(
        dy, None, x, ctx.normalized_shape, weight, has_bias, mean, rstd
    )
    return (
        dx,
        None,
        dweight if weight is not None else None,
        dbias.to(ctx.bias_dtype) if has_bias else None,
        None,
    )


def _add_layer_norm_setup(ctx, inputs, output) -> None:
    x, residual, weight, bias, _ = inputs
    _, summed, mean, rstd = output
    ctx.save_for_backward(summed, weight, mean, rstd)
    ctx.dtypes = (x.dtype, residual.dtype, bias.dtype if bias is not None else None)
    ctx.mark_non_differentiable(mean, rstd)


def _add_layer_norm_backward(ctx, dy, dsum, _dmean, _drstd):
    summed, weight, mean, rstd = ctx.saved_tensors
    x_dtype, residual_dtype, bias_dtype = ctx.dtypes
    dx, dweight, dbias = torch.ops.fabriclite.layer_norm_backward(
        dy, dsum, summed, [summed.shape[-1]], weight, bias_dtype is not None, mean, rstd
    )
    return (
        dx.to(x_dtype),
        dx.to(residual_dtype),
        dweight if weight is not None else None,
        dbias.to(bias_dtype) if bias_dtype is not None else None,
        None,
    )


_layer_norm_op.register_autograd(_layer_norm_backward, setup_context=_layer_norm_setup)
_add_layer_norm_op.register_autograd(_add_layer_norm_backward, setup_context=_add_layer_norm_setup)


# ---------------------------------------------------------------------- public API
def layer_norm(
    x: torch.Tensor,
    normalized_shape: Union[int, list[int], tuple[int, ...], torch.Size],
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> torch.Tensor:
    """``F.layer_norm`` on the Triton kernels (fp32 statistics, output in x's dtype).

    Usage: ``y = layer_norm(x, (768,), weight, bias, eps=1e-5)``.
    """
    shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    if list(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(f"layer_norm over {shape} needs an input ending in those sizes; got {tuple(x.shape)}.")
    check_dtypes("layer_norm", "torch.nn.functional.layer_norm", x, weight, bias)
    return torch.ops.fabriclite.layer_norm(x, shape, weight, bias, float(eps))[0]


def add_layer_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    eps: float = 1e-5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(layer_norm(x + residual), x + residual)`` over the last dimension, in one kernel.

    Usage: ``normed, hidden = add_layer_norm(attn_out, hidden, ln.weight, ln.bias, ln.eps)``.
    """
    if x.shape != residual.shape:
        raise ValueError(
            f"add_layer_norm needs x and residual of one shape (no broadcasting); got {tuple(x.shape)} and "
            f"{tuple(residual.shape)}."
        )
    check_dtypes("add_layer_norm", "torch.nn.functional.layer_norm(x + residual, ...)", x, residual, weight, bias)
    y, summed, _, _ = torch.ops.fabriclite.add_layer_norm(x, residual, weight, bias, float(eps))
    return y, summed


class LayerNorm(torch.nn.LayerNorm):
    """``nn.LayerNorm`` (same parameters, state_dict keys and arguments) whose forward runs the Triton kernels.

    Usage: ``norm = LayerNorm(768)``, or ``swap_modules(model)`` to replace a model's ``nn.LayerNorm`` in place.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


__all__ = ["LayerNorm", "add_layer_norm", "layer_norm"]
