"""The one implementation behind layer norm and RMS norm, alone or fused with the residual add in front of them
(``fused_layer_norm.py`` and ``fused_rms_norm.py`` hold only their public functions and modules).

Forward: one row per program, the whole row in one block; the statistics are computed in fp32 and saved for the
backward in one fp32 tensor ``stats``: every row's rstd, then (layer norm only) every row's mean. RMS norm is layer
norm without the centring, so one kernel serves both (``RMS``, a compile-time switch). With a residual the kernel
also writes ``x + residual``, the residual stream a pre-norm transformer carries on, and normalizes that sum as
stored: it leaves the registers once, instead of an add kernel writing it and a norm kernel reading it back.

Backward: each program walks a contiguous range of rows, writes their input gradient and keeps fp32 partial sums
of the weight (and bias) gradient in registers; a second reduction (torch's ``sum`` over the programs) adds up the
partials. A program walks its rows in tiles (several narrow rows at once, one wide row), about 8 elements a
thread, and loads the next tile's ``dy`` and ``x`` before it reduces the current one. One row at a time with nothing
loaded ahead (Liger-Kernel's backward, and this one until issue 40), few programs fit on a multiprocessor and each
waits on every row's loads: too few bytes on their way for the memory to run at full speed (see
``_backward_sizes``). The residual-add form's backward adds the gradient arriving at the sum output to the input
gradient, and that total is the gradient of both ``x`` and ``residual``.

Two ways in, one computation: eager calls go through ``_NormFunction`` (a ``torch.autograd.Function`` launching
the kernels directly, without the custom op's Python dispatch, which cost hundreds of microseconds a call on an
H100), traced code (``torch.compile``) through the ``fabriclite::norm`` custom op and its backward op, which the
compiler can place in its graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from fabriclite.kernels._common import (
    PROGRAMS_PER_MULTIPROCESSOR,
    cast,
    cdiv,
    launch,
    launch_sizes,
    library_op,
    num_warps,
    reduction_programs,
    row_block,
    rows_and_strides,
)
from fabriclite.kernels.swap import row_loop_measured_faster


@triton.jit
def _norm_forward_kernel(
    x_ptr,
    x_row_stride,
    residual_ptr,
    residual_row_stride,
    sum_ptr,
    y_ptr,
    weight_ptr,
    bias_ptr,
    stats_ptr,
    n_cols,
    eps,
    RMS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # fp32 however it is launched: Inductor passes a Python float as fp64 (Triton's JIT as fp32).
    eps = tl.cast(eps, tl.float32)
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
    if RMS:
        centered = x  # masked columns loaded as 0
    else:
        mean = tl.sum(x, axis=0) / n_cols
        centered = tl.where(mask, x - mean, 0.0)
        tl.store(stats_ptr + tl.num_programs(0) + row, mean)
    rstd = tl.rsqrt(tl.sum(centered * centered, axis=0) / n_cols + eps)
    y = centered * rstd
    if HAS_WEIGHT:
        y = y * tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(stats_ptr + row, rstd)


@triton.jit
def _norm_backward_kernel(
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
    stats_ptr,
    partials_ptr,
    n_rows,
    n_cols,
    rows_per_program,
    RMS: tl.constexpr,
    HAS_DSUM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
    ROWS: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    # A tile is ROWS rows of the program's range; with PREFETCH the next tile's dy and x are loaded before this
    # tile's sums, so that the loads of one tile are in flight while the previous one is reduced.
    program = tl.program_id(0).to(tl.int64)
    row_start = program * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < n_cols
    tile = tl.arange(0, ROWS)
    if HAS_WEIGHT:
        weight = tl.load(weight_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    dweight = tl.zeros((BLOCK,), dtype=tl.float32)
    dbias = tl.zeros((BLOCK,), dtype=tl.float32)
    if PREFETCH:
        rows = row_start + tile
        mask = (rows < row_end)[:, None] & col_mask[None, :]
        # dy may be an expanded gradient (strides 0), hence both strides.
        next_dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride, mask=mask, other=0.0)
        next_x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0)
    # Counting from 0 and adding to the int64 start keeps rows int64 in the interpreter too, where a loop variable
    # from range(row_start, ...) is a Python int that becomes int32 in arithmetic.
    for offset in range(0, row_end - row_start, ROWS):
        rows = row_start + offset + tile
        row_mask = rows < row_end
        mask = row_mask[:, None] & col_mask[None, :]
        if PREFETCH:
            dy = next_dy.to(tl.float32)
            x = next_x.to(tl.float32)
            rows_after = rows + ROWS
            mask_after = (rows_after < row_end)[:, None] & col_mask[None, :]
            next_dy = tl.load(
                dy_ptr + rows_after[:, None] * dy_row_stride + cols[None, :] * dy_col_stride,
                mask=mask_after,
                other=0.0,
            )
            next_x = tl.load(x_ptr + rows_after[:, None] * x_row_stride + cols[None, :], mask=mask_after, other=0.0)
        else:
            dy = tl.load(
                dy_ptr + rows[:, None] * dy_row_stride + cols[None, :] * dy_col_stride, mask=mask, other=0.0
            ).to(tl.float32)
            x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_DSUM:
            dsum = tl.load(
                dsum_ptr + rows[:, None] * dsum_row_stride + cols[None, :] * dsum_col_stride, mask=mask, other=0.0
            )
        rstd = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)[:, None]
        if RMS:
            x_hat = x * rstd  # masked columns and rows loaded as 0
        else:
            mean = tl.load(stats_ptr + n_rows + rows, mask=row_mask, other=0.0)[:, None]
            x_hat = tl.where(mask, (x - mean) * rstd, 0.0)
        if HAS_WEIGHT:
            w_dy = dy * weight
        else:
            w_dy = dy
        # dx = rstd * (w_dy - mean(w_dy) - x_hat * mean(w_dy * x_hat)); RMS norm has no mean(w_dy) term.
        dx = w_dy - x_hat * (tl.sum(w_dy * x_hat, axis=1) / n_cols)[:, None]
        if not RMS:
            dx -= (tl.sum(w_dy, axis=1) / n_cols)[:, None]
        dx *= rstd
        if HAS_DSUM:
            dx += dsum.to(tl.float32)
        tl.store(dx_ptr + rows[:, None] * n_cols + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            dweight += tl.sum(dy * x_hat, axis=0)
        if HAS_BIAS:
            dbias += tl.sum(dy, axis=0)
    # partials: the weight's fp32 partial sums, one row per program, then the bias's.
    if HAS_WEIGHT:
        tl.store(partials_ptr + program * n_cols + cols, dweight, mask=col_mask)
        partials_ptr += tl.num_programs(0) * n_cols
    if HAS_BIAS:
        tl.store(partials_ptr + program * n_cols + cols, dbias, mask=col_mask)


@launch_sizes
def _launch_sizes(n_cols: int) -> tuple[int, int]:
    """(block, num_warps) for rows of ``n_cols``: depends on the width only, so it is worked out once per width."""
    block = row_block(n_cols)
    return block, num_warps(block)


# The backward's launch plan. Register use decides it: ptxas for sm_90 (Triton's own, no GPU needed; issue 40) gives
# the row loop at width 4096 109-118 registers a thread at 8 warps, so at most two of its 8-warp programs fit on a
# multiprocessor, each waiting on every row's loads. Tiles of at least TILE_ELEMENTS (several narrow rows, one wide
# row), ELEMENTS_PER_THREAD of them per thread, with the next tile loaded ahead, take 64-87 registers up to width
# 2048 (3-8 programs of 4-8 warps fit), and at 4096 64-101 (two or one of 16 warps), with twice the bytes on their
# way. Rows wider than PREFETCH_MAX_BLOCK take the row loop, whose registers they already fill; so do the widths where
# it measured faster (kernels/swap.py). ROW_LOOP_BACKWARD = True: the row loop everywhere, for benchmarks/kernels.py.
TILE_ELEMENTS = 1024
ELEMENTS_PER_THREAD = 8
PREFETCH_MAX_BLOCK = 8192
ROW_LOOP_BACKWARD = False


@launch_sizes
def _backward_sizes(n_cols: int, row_loop: bool) -> tuple[int, int, int, bool, int]:
    """(block, rows per tile, num_warps, prefetch, programs per multiprocessor) of the backward for rows of
    ``n_cols``, worked out once per width. Programs beyond what fits on a multiprocessor wait their turn, so the
    count asks for as many as the threads allow (at most 8); the registers decide how many run at once."""
    block = row_block(n_cols)
    if row_loop or block > PREFETCH_MAX_BLOCK:
        return block, 1, num_warps(block), False, PROGRAMS_PER_MULTIPROCESSOR
    rows = max(1, TILE_ELEMENTS // block)
    warps = min(16, max(4, rows * block // (32 * ELEMENTS_PER_THREAD)))
    return block, rows, warps, True, min(8, 64 // warps)


def _forward(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    n_cols: int,
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    eps: float,
    rms: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Returns (y, x + residual or None, stats): y and the sum shaped like x, stats the rows' rstd then (layer norm)
    their means."""
    block, warps = _launch_sizes(n_cols)
    n_rows = x.numel() // n_cols
    x_rows, x_stride, _ = rows_and_strides(x, n_cols, unit_col_stride=True)
    if residual is not None:
        residual_rows, residual_stride, _ = rows_and_strides(residual, n_cols, unit_col_stride=True)
        summed = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        y = torch.empty_like(summed)
    else:
        residual_rows, residual_stride, summed = x_rows, x_stride, None
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # The per-row rstd, then (layer norm) the per-row mean, in one allocation.
    stats = torch.empty((1 if rms else 2) * n_rows, dtype=torch.float32, device=x.device)
    # Parameters are contiguous in practice; .contiguous() would still cost a dispatch per call.
    if weight is not None and not weight.is_contiguous():
        weight = weight.contiguous()
    if bias is not None and not bias.is_contiguous():
        bias = bias.contiguous()
    if n_rows > 0:
        launch(
            _norm_forward_kernel,
            (n_rows,),
            x_rows,
            x_stride,
            residual_rows,
            residual_stride,
            y if summed is None else summed,
            y,
            x_rows if weight is None else weight,
            x_rows if bias is None else bias,
            stats,
            n_cols,
            eps,
            RMS=rms,
            HAS_RESIDUAL=residual is not None,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=warps,
        )
    return y, summed, stats


def _backward(
    dy: torch.Tensor,
    dsum: Optional[torch.Tensor],
    x: torch.Tensor,
    n_cols: int,
    weight: Optional[torch.Tensor],
    has_bias: bool,
    stats: torch.Tensor,
    rms: bool,
) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """Returns (dx, dweight, dbias): dx shaped like x and including ``dsum``; dweight in the weight's dtype and
    shape, dbias (fp32, shaped like the weight or the rows) None when there is no weight or no bias."""
    row_loop = ROW_LOOP_BACKWARD or row_loop_measured_faster(x.device, "rms_norm" if rms else "layer_norm", n_cols)
    block, tile_rows, warps, prefetch, per_multiprocessor = _backward_sizes(n_cols, row_loop)
    n_rows = x.numel() // n_cols
    x_rows, x_stride, _ = rows_and_strides(x, n_cols, unit_col_stride=True)
    # dy may be an expanded gradient (strides 0), hence both strides.
    dy_rows, dy_row_stride, dy_col_stride = rows_and_strides(dy, n_cols)
    if dsum is not None:
        dsum_rows, dsum_row_stride, dsum_col_stride = rows_and_strides(dsum, n_cols)
    else:
        dsum_rows, dsum_row_stride, dsum_col_stride = dy_rows, dy_row_stride, dy_col_stride
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if weight is not None and not weight.is_contiguous():
        weight = weight.contiguous()
    # Whole tiles per program, and no program without rows.
    rows_per_program = tile_rows * cdiv(n_rows, tile_rows * reduction_programs(x.device, n_rows, per_multiprocessor))
    programs = cdiv(n_rows, rows_per_program) if n_rows else 1
    # The weight's and the bias's fp32 partials, one row per program, in one buffer.
    n_partials = (weight is not None) + has_bias
    # No rows, no launch: the partials must then be zeros (a sum of nothing), not whatever the memory held.
    allocate = torch.empty if n_rows else torch.zeros
    # Two dimensions, never a leading one of size 1: under compile with a dynamic batch, Inductor gives a Triton
    # kernel's argument the traced strides, and a size-1 dimension's (n_cols * Max(1, programs), n_cols * programs in
    # Inductor) made it copy the buffer onto itself: "InductorError: KeyError: 'op24'" (pytorch#189271).
    partials = allocate((n_partials * programs, n_cols), dtype=torch.float32, device=x.device) if n_partials else dx
    if n_rows > 0:
        launch(
            _norm_backward_kernel,
            (programs,),
            dx,
            dy_rows,
            dy_row_stride,
            dy_col_stride,
            dsum_rows,
            dsum_row_stride,
            dsum_col_stride,
            x_rows,
            x_stride,
            x_rows if weight is None else weight,
            stats,
            partials,
            n_rows,
            n_cols,
            rows_per_program,
            RMS=rms,
            HAS_DSUM=dsum is not None,
            HAS_WEIGHT=weight is not None,
            HAS_BIAS=has_bias,
            BLOCK=block,
            ROWS=tile_rows,
            PREFETCH=prefetch,
            num_warps=warps,
        )
    if not n_partials:
        return dx, None, None
    sums = partials.view(n_partials, programs, n_cols).sum(1).unbind(0)  # the second reduction, in fp32
    dweight = None
    if weight is not None:
        dweight = cast(sums[0], weight.dtype)
        if weight.dim() != 1:
            dweight = dweight.view(weight.shape)
    dbias = sums[-1] if has_bias else None
    return dx, dweight, dbias


def _input_grads(
    dx: torch.Tensor, dweight: Optional[torch.Tensor], dbias: Optional[torch.Tensor], dtypes: tuple
) -> tuple[Optional[torch.Tensor], ...]:
    """(dx, dresidual, dweight, dbias) in the dtypes of x, residual (None without one) and bias."""
    x_dtype, residual_dtype, bias_dtype, bias_shape = dtypes
    dresidual = None if residual_dtype is None else cast(dx, residual_dtype)
    if dbias is not None:
        dbias = cast(dbias, bias_dtype)
        if len(bias_shape) != 1:
            dbias = dbias.view(bias_shape)
    return cast(dx, x_dtype), dresidual, dweight, dbias


def _dtypes(x: torch.Tensor, residual: Optional[torch.Tensor], bias: Optional[torch.Tensor]) -> tuple:
    return (
        x.dtype,
        None if residual is None else residual.dtype,
        None if bias is None else bias.dtype,
        None if bias is None else bias.shape,
    )


# ---------------------------------------------------------------------- eager: an autograd Function
class _NormFunction(torch.autograd.Function):
    """Eager calls: launches the kernels directly, with no dispatcher in between. Returns y, or (y, x + residual)
    when a residual is given."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, n_cols, eps, rms):
        y, summed, stats = _forward(x, residual, n_cols, weight, bias, eps, rms)
        ctx.save_for_backward(x if summed is None else summed, weight, stats)
        ctx.config = (n_cols, rms, _dtypes(x, residual, bias))
        ctx.set_materialize_grads(False)  # no zeros for an output nobody used (the last layer's sum)
        if summed is None:
            return y
        return y, summed

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy, dsum=None):
        x, weight, stats = ctx.saved_tensors
        n_cols, rms, dtypes = ctx.config
        has_bias = dtypes[2] is not None
        if dy is None:  # only the sum x + residual was used
            dy = torch.zeros_like(x)
        dx, dweight, dbias = _backward(dy, dsum, x, n_cols, weight, has_bias, stats, rms)
        dx, dresidual, dweight, dbias = _input_grads(dx, dweight, dbias, dtypes)
        return dx, dresidual, dweight, dbias, None, None, None


# ---------------------------------------------------------------------- traced: torch.library custom ops
def _norm_op_fake(x, residual, weight, bias, n_cols, eps, rms):
    n_rows = x.numel() // n_cols
    dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = x.new_empty(x.shape, dtype=dtype)
    summed = torch.empty_like(y) if residual is not None else x.new_empty(0)
    return y, summed, x.new_empty((1 if rms else 2) * n_rows, dtype=torch.float32)


@library_op("fabriclite::norm", fake=_norm_op_fake)
def _norm_op(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    n_cols: int,
    eps: float,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (y, x + residual (empty without a residual), stats): stats holds the rows' rstd, then for layer norm
    their means, in fp32."""
    y, summed, stats = _forward(x, residual, n_cols, weight, bias, eps, rms)
    return y, summed if summed is not None else x.new_empty(0), stats


def _norm_backward_op_fake(dy, dsum, x, n_cols, weight, has_bias, stats, rms):
    dx = torch.empty_like(x, memory_format=torch.contiguous_format)
    dweight = torch.empty_like(weight) if weight is not None else x.new_empty(0, dtype=torch.float32)
    dbias = x.new_empty(n_cols if has_bias else 0, dtype=torch.float32)
    return dx, dweight, dbias


@library_op("fabriclite::norm_backward", fake=_norm_backward_op_fake)
def _norm_backward_op(
    dy: torch.Tensor,
    dsum: Optional[torch.Tensor],
    x: torch.Tensor,
    n_cols: int,
    weight: Optional[torch.Tensor],
    has_bias: bool,
    stats: torch.Tensor,
    rms: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx, dweight, dbias) where dx includes ``dsum``; dweight or dbias (fp32, flat) is empty when absent."""
    dx, dweight, dbias = _backward(dy, dsum, x, n_cols, weight, has_bias, stats, rms)
    empty = x.new_empty(0, dtype=torch.float32)
    # Outputs of a custom op may not share memory: both gradients are rows of one sum.
    dweight = dweight.clone() if dweight is not None else empty
    return dx, dweight, dbias.clone() if dbias is not None else empty.clone()


def _setup_context(ctx, inputs, output) -> None:
    x, residual, weight, bias, n_cols, _, rms = inputs
    _, summed, stats = output
    ctx.save_for_backward(x if residual is None else summed, weight, stats)
    ctx.config = (n_cols, rms, _dtypes(x, residual, bias))
    ctx.mark_non_differentiable(stats)
    if residual is None:
        ctx.mark_non_differentiable(summed)


def _backward_formula(ctx, dy, dsum, _dstats):
    x, weight, stats = ctx.saved_tensors
    n_cols, rms, dtypes = ctx.config
    has_bias = dtypes[2] is not None
    if dtypes[1] is None:
        dsum = None  # the empty placeholder output
    dx, dweight, dbias = torch.ops.fabriclite.norm_backward(dy, dsum, x, n_cols, weight, has_bias, stats, rms)
    dx, dresidual, dweight, dbias = _input_grads(
        dx, dweight if weight is not None else None, dbias if has_bias else None, dtypes
    )
    return dx, dresidual, dweight, dbias, None, None, None


_norm_op.register_autograd(_backward_formula, setup_context=_setup_context)


def norm(
    x: torch.Tensor,
    residual: Optional[torch.Tensor],
    weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor],
    n_cols: int,
    eps: float,
    rms: bool,
):
    """Layer norm (``rms=False``) or RMS norm of ``x`` (or of ``x + residual``) over its last ``n_cols`` elements:
    y, or (y, x + residual) with a residual. The public functions check the arguments and call this.

    Usage: ``y = norm(x, None, weight, bias, 768, 1e-5, rms=False)``.
    """
    if torch.compiler.is_compiling():
        y, summed, _ = torch.ops.fabriclite.norm(x, residual, weight, bias, n_cols, eps, rms)
        return y if residual is None else (y, summed)
    return _NormFunction.apply(x, residual, weight, bias, n_cols, eps, rms)
