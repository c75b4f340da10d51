"""RMS norm: ``x * rsqrt(mean(x ** 2) + eps) * weight`` over the trailing dimensions, as ``F.rms_norm``, alone or
fused with the residual add in front of it (``add_rms_norm``).

Forward: one row per program, the whole row in one block, fp32 statistics; the per-row rstd (one fp32) is saved for
the backward. With a residual the kernel also writes ``x + residual`` (the residual stream of a pre-norm
transformer) and normalizes that sum as stored. Backward: each program walks a contiguous range of rows, writes
their input gradient and keeps an fp32 partial sum of the weight gradient; the host adds up the partials.
``add_rms_norm``'s backward adds the gradient arriving at the sum output to the input gradient, and that total is
the gradient of both ``x`` and ``residual``. ``eps=None`` means fp32's eps, as in torch, which computes fp32, bf16
and fp16 RMS norm in fp32 and takes the eps of that dtype (bf16's own, 0.0078, would swamp ``mean(x ** 2)`` of
small activations).
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
def _rms_norm_forward_kernel(
    x_ptr,
    x_row_stride,
    residual_ptr,
    residual_row_stride,
    sum_ptr,
    y_ptr,
    weight_ptr,
    rstd_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
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
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    y = x * rstd
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_backward_kernel(
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
    rstd_ptr,
    dweight_partial_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    HAS_DSUM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
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
    for i in range(0, rows_here):
        row = row_start + i
        # dy may be an expanded gradient (strides 0), hence both strides.
        dy = tl.load(dy_ptr + row * dy_row_stride + cols * dy_col_stride, mask=mask, other=0.0).to(tl.float32)
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        if HAS_WEIGHT:
            w_dy = dy * weight
        else:
            w_dy = dy
        # dx = rstd * (w_dy - x_hat * mean(w_dy * x_hat))
        dx = (w_dy - x_hat * (tl.sum(w_dy * x_hat, axis=0) / n_cols)) * rstd
        if HAS_DSUM:
            dx += tl.load(dsum_ptr + row * dsum_row_stride + cols * dsum_col_stride, mask=mask, other=0.0).to(
                tl.float32
            )
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dweight += dy * x_hat
    if HAS_WEIGHT:
        tl.store(dweight_partial_ptr + program * n_cols + cols, dweight, mask=mask)


def _forward(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    normalized_shape: list[int],
    weight: Optional[torch.Tensor],
    eps: float,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Returns (y, x + residual or None, rstd), y and the sum shaped like x, rstd like x's leading dimensions."""
    n_cols = math.prod(normalized_shape)
    x_rows = contiguous_rows(x, n_cols)
    n_rows = x_rows.shape[0]
    if residual is not None:
        residual_rows = contiguous_rows(residual, n_cols)
        summed = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    else:
        residual_rows, summed = x_rows, None
    y = torch.empty(x.shape, dtype=x.dtype if summed is None else summed.dtype, device=x.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x.device)
    weight = weight.contiguous() if weight is not None else None
    block = row_block(n_cols)
    if n_rows > 0:
        launch(
            _rms_norm_forward_kernel,
            (n_rows,),
            x_rows,
            x_rows.stride(0),
            residual_rows,
            residual_rows.stride(0),
            y if summed is None else summed,
            y,
            x_rows if weight is None else weight,
            rstd,
            n_cols,
            eps,
            HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None,
            BLOCK=block,
            num_warps=num_warps(block),
        )
    return y, summed, rstd.view(x.shape[: x.dim() - len(normalized_shape)])


def _backward(
    dy: torch.Tensor,
    dsum: Optional[torch.Tensor],
    x: torch.Tensor,
    normalized_shape: list[int],
    weight: Optional[torch.Tensor],
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight) where dx includes ``dsum``; dweight is empty without a weight."""
    n_cols = math.prod(normalized_shape)
    x_rows = contiguous_rows(x, n_cols)
    n_rows = x_rows.shape[0]
    dy_rows = as_rows(dy, n_cols)
    dsum_rows = as_rows(dsum, n_cols) if dsum is not None else dy_rows
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    weight = weight.contiguous() if weight is not None else None
    programs = reduction_programs(x.device, n_rows)
    partials = (programs if n_rows > 0 else 0, n_cols) if weight is not None else (0,)
    dweight = torch.empty(partials, dtype=torch.float32, device=x.device)
    block = row_block(n_cols)
    if n_rows > 0:
        launch(
            _rms_norm_backward_kernel,
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
            rstd,
            dweight,
            n_rows,
            n_cols,
            triton.cdiv(n_rows, programs),
            HAS_DSUM=dsum is not None,
            HAS_WEIGHT=weight is not None,
            BLOCK=block,
            num_warps=num_warps(block),
        )
    if weight is not None:
        dweight = dweight.sum(0).to(weight.dtype).view(normalized_shape)
    return dx, dweight


# ---------------------------------------------------------------------- torch.library registration
@torch.library.custom_op("fabriclite::rms_norm", mutates_args=())
def _rms_norm_op(
    x: torch.Tensor, normalized_shape: list[int], weight: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (y, rstd)."""
    y, _, rstd = _forward(x, None, normalized_shape, weight, eps)
    return y, rstd


@_rms_norm_op.register_fake
def _(x, normalized_shape, weight, eps):
    rstd = x.new_empty(x.shape[: x.dim() - len(normalized_shape)], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), rstd


@torch.library.custom_op("fabriclite::add_rms_norm", mutates_args=())
def _add_rms_norm_op(
    x: torch.Tensor, residual: torch.Tensor, weight: Optional[torch.Tensor], eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual, rstd), normalizing over the last dimension."""
    y, summed, rstd = _forward(x, residual, [x.shape[-1]], weight, eps)
    return y, summed, rstd


@_add_rms_norm_op.register_fake
def _(x, residual, weight, eps):
    out = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype))
    return out, torch.empty_like(out), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("fabriclite::rms_norm_backward", mutates_args=())
def _rms_norm_backward_op(
    dy: torch.Tensor,
    dsum: Optional[torch.Tensor],
    x: torch.Tensor,
    normalized_shape: list[int],
    weight: Optional[torch.Tensor],
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight) where dx includes ``dsum``; dweight is empty without a weight."""
    return _backward(dy, dsum, x, normalized_shape, weight, rstd)


@_rms_norm_backward_op.register_fake
def _(dy, dsum, x, normalized_shape, weight, rstd):
    dweight = torch.empty_like(weight) if weight is not None else x.new_empty(0, dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), dweight


def _setup_context(ctx, inputs, output) -> None:
    x, normalized_shape, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.normalized_shape = normalized_shape
    ctx.mark_non_differentiable(output[1])


def _backward_formula(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dweight = torch.ops.fabriclite.rms_norm_backward(dy, None, x, ctx.normalized_shape, weight, rstd)
    return dx, None, dweight if weight is not None else None, None


def _add_setup_context(ctx, inputs, output) -> None:
    x, residual, weight, _ = inputs
    _, summed, rstd = output
    ctx.save_for_backward(summed, weight, rstd)
    ctx.dtypes = (x.dtype, residual.dtype)
    ctx.mark_non_differentiable(rstd)


def _add_backward_formula(ctx, dy, dsum, _drstd):
    summed, weight, rstd = ctx.saved_tensors
    x_dtype, residual_dtype = ctx.dtypes
    dx, dweight = torch.ops.fabriclite.rms_norm_backward(dy, dsum, summed, [summed.shape[-1]], weight, rstd)
    return dx.to(x_dtype), dx.to(residual_dtype), dweight if weight is not None else None, None


_rms_norm_op.register_autograd(_backward_formula, setup_context=_setup_context)
_add_rms_norm_op.register_autograd(_add_backward_formula, setup_context=_add_setup_context)


# ---------------------------------------------------------------------- public API
def rms_norm(
    x: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
    normalized_shape: Union[int, list[int], tuple[int, ...], torch.Size, None] = None,
) -> torch.Tensor:
    """``x * rsqrt(mean(x ** 2) + eps) * weight`` over ``normalized_shape`` (default: weight's shape, else the
    last dimension), as ``F.rms_norm(x, normalized_shape, weight, eps)``; ``eps=None`` is fp32's eps, as in torch.

    Usage: ``y = rms_norm(x, weight, eps=1e-6)``.
    """
    if normalized_shape is None:
        shape = list(weight.shape) if weight is not None else [x.shape[-1]]
    else:
        shape = [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)
    if list(x.shape[x.dim() - len(shape) :]) != shape:
        raise ValueError(f"rms_norm over {shape} needs an input ending in those sizes; got {tuple(x.shape)}.")
    check_dtypes("rms_norm", "torch.nn.functional.rms_norm", x, weight)
    if eps is None:
        eps = torch.finfo(torch.float32).eps  # the dtype the kernel computes in, whatever x's dtype
    return torch.ops.fabriclite.rms_norm(x, shape, weight, float(eps))[0]


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: Optional[torch.Tensor] = None,
    eps: Optional[float] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(x + residual, weight, eps), x + residual)`` over the last dimension, in one kernel; ``eps=None``
    is fp32's eps, as in ``rms_norm``.

    Usage: ``normed, hidden = add_rms_norm(attn_out, hidden, norm.weight, norm.eps)``.
    """
    if x.shape != residual.shape:
        raise ValueError(
            f"add_rms_norm needs x and residual of one shape (no broadcasting); got {tuple(x.shape)} and "
            f"{tuple(residual.shape)}."
        )
    if x.dim() == 0 or (weight is not None and tuple(weight.shape) != (x.shape[-1],)):
        weight_shape = None if weight is None else tuple(weight.shape)
        raise ValueError(
            f"add_rms_norm normalizes over the last dimension and needs a 1-D weight as long as it; got x "
            f"{tuple(x.shape)} and weight {weight_shape}. For several trailing dimensions use rms_norm(x + residual)."
        )
    check_dtypes("add_rms_norm", "torch.nn.functional.rms_norm(x + residual, ...)", x, residual, weight)
    if eps is None:
        eps = torch.finfo(torch.float32).eps  # the dtype the kernel computes in, whatever x's dtype
    y, summed, _ = torch.ops.fabriclite.add_rms_norm(x, residual, weight, float(eps))
    return y, summed


class RMSNorm(torch.nn.RMSNorm):
    """``nn.RMSNorm`` (same parameters, state_dict keys and arguments) whose forward runs the Triton kernels.

    Usage: ``norm = RMSNorm(4096, eps=1e-6)``, or ``swap_modules(model)`` to replace a model's ``nn.RMSNorm``.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.normalized_shape)


__all__ = ["RMSNorm", "add_rms_norm", "rms_norm"]
