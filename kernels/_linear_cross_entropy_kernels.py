"""The Triton kernels of ``fused_linear_cross_entropy`` and their launches: per chunk of logits (columns of the
vocabulary, or whole rows), the forward folds the chunk's logits into each token's running max and sum (online
softmax) and writes the loss after the last chunk (``fold``); the backward overwrites the chunk's logits with their
gradient (``overwrite_with_gradient``). The designs that call them, and what the passes compute, are described in
``fused_linear_cross_entropy``."""

from typing import Optional

import triton
import triton.language as tl

from fabriclite.kernels._common import cdiv, launch, launch_sizes, num_warps


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exp overflowing to inf gives 1, underflowing to 0 gives -1.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _linear_cross_entropy_forward_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    state_ptr,
    loss_ptr,
    n_rows,
    n_cols,
    col_start,
    vocab_size,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss,
    FIRST: tl.constexpr,
    LAST: tl.constexpr,
    SMOOTHING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    Z_LOSS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # fp32 however it is launched: Inductor passes a Python float as fp64 (Triton's JIT as fp32).
    label_smoothing = tl.cast(label_smoothing, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    z_loss = tl.cast(z_loss, tl.float32)
    # BLOCK_M rows of one chunk. state holds, per row: m, d, the smoothing sum, its reference, the target's logit.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    row_ptrs = logits_ptr + rows * logits_row_stride
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
    if FIRST:
        first = tl.load(row_ptrs, mask=row_mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            first = softcap * _tanh(first / softcap)
        ref = tl.where(first == float("-inf"), 0.0, first)
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        d = tl.zeros((BLOCK_M,), tl.float32)
        sum_x = tl.zeros((BLOCK_M,), tl.float32)
        x_target = tl.zeros((BLOCK_M,), tl.float32)
    else:
        m = tl.load(state_ptr + rows, mask=row_mask, other=0.0)
        d = tl.load(state_ptr + n_rows + rows, mask=row_mask, other=1.0)
        sum_x = tl.load(state_ptr + 2 * n_rows + rows, mask=row_mask, other=0.0)
        ref = tl.load(state_ptr + 3 * n_rows + rows, mask=row_mask, other=0.0)
        x_target = tl.load(state_ptr + 4 * n_rows + rows, mask=row_mask, other=0.0)

    local_target = target - col_start
    in_chunk = row_mask & (local_target >= 0) & (local_target < n_cols)
    picked = tl.load(row_ptrs + local_target, mask=in_chunk, other=0.0).to(tl.float32)
    if SOFTCAP:
        picked = softcap * _tanh(picked / softcap)
    x_target = tl.where(in_chunk, picked, x_target)

    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols[None, :] < n_cols)
        x = tl.load(row_ptrs[:, None] + cols[None, :], mask=mask, other=float("-inf")).to(tl.float32)
        if SOFTCAP:
            x = tl.where(mask, softcap * _tanh(x / softcap), float("-inf"))
        m_new = tl.maximum(m, tl.max(x, axis=1))
        # A block of -inf logits leaves m_new at -inf; shifting by 0 then keeps exp() at 0, not NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift[:, None]), axis=1)
        if SMOOTHING:
            sum_x += tl.sum(tl.where(mask, x - ref[:, None], 0.0), axis=1)
        m = m_new

    tl.store(state_ptr + rows, m, mask=row_mask)
    tl.store(state_ptr + n_rows + rows, d, mask=row_mask)
    tl.store(state_ptr + 2 * n_rows + rows, sum_x, mask=row_mask)
    tl.store(state_ptr + 3 * n_rows + rows, ref, mask=row_mask)
    tl.store(state_ptr + 4 * n_rows + rows, x_target, mask=row_mask)
    if LAST:
        log_d = tl.log(d)
        # -log p_target = lse - x_target, and with smoothing eps/V * sum_c -log p_c = eps * (lse - mean(x)).
        loss = (m - x_target) + log_d
        if SMOOTHING:
            smooth = (m - ref) + log_d - sum_x / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
        if Z_LOSS:
            lse = m + log_d
            loss += z_loss * lse * lse
        tl.store(loss_ptr + rows, tl.where(target == ignore_index, 0.0, loss), mask=row_mask)


@triton.jit
def _linear_cross_entropy_backward_kernel(
    logits_ptr,
    logits_row_stride,
    target_ptr,
    state_ptr,
    grad_output_ptr,
    grad_output_stride,
    n_valid_ptr,
    n_rows,
    n_cols,
    col_start,
    vocab_size,
    ignore_index,
    label_smoothing,
    softcap,
    z_loss,
    MEAN: tl.constexpr,
    SMOOTHING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    Z_LOSS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # fp32 however it is launched: Inductor passes a Python float as fp64 (Triton's JIT as fp32).
    label_smoothing = tl.cast(label_smoothing, tl.float32)
    softcap = tl.cast(softcap, tl.float32)
    z_loss = tl.cast(z_loss, tl.float32)
    # BLOCK_M rows of one chunk: their logits overwritten with their gradient, each element read before it is
    # written by the same program.
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    row_ptrs = logits_ptr + rows * logits_row_stride
    target = tl.load(target_ptr + rows, mask=row_mask, other=ignore_index)
    valid = row_mask & (target != ignore_index)
    # A scalar grad_output ("mean", "sum") has stride 0: every row reads the same element.
    scale = tl.load(grad_output_ptr + rows * grad_output_stride, mask=row_mask, other=0.0).to(tl.float32)
    if MEAN:
        scale = scale / tl.load(n_valid_ptr).to(tl.float32)
    m = tl.load(state_ptr + rows, mask=row_mask, other=0.0)
    d = tl.load(state_ptr + n_rows + rows, mask=row_mask, other=1.0)
    # d (z_loss * lse ** 2) / d x_c = 2 * z_loss * lse * p_c: the softmax term grows by that factor.
    growth = tl.full((BLOCK_M,), 1.0, tl.float32)
    if Z_LOSS:
        growth = 1.0 + 2.0 * z_loss * (m + tl.log(d))
    local_target = target - col_start
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = row_mask[:, None] & (cols[None, :] < n_cols)
        x = tl.load(row_ptrs[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if SOFTCAP:
            t = _tanh(x / softcap)
            x = softcap * t
        grad = tl.exp(x - m[:, None]) / d[:, None] * growth[:, None]
        is_target = cols[None, :] == local_target[:, None]
        if SMOOTHING:
            grad = grad - label_smoothing / vocab_size
            grad = tl.where(is_target, grad - (1.0 - label_smoothing), grad)
        else:
            grad = tl.where(is_target, grad - 1.0, grad)
        grad = grad * scale[:, None]
        if SOFTCAP:
            grad = grad * (1.0 - t * t)  # d capped / d logits
        grad = tl.where(valid[:, None], grad, 0.0)  # ignored rows: no gradient
        tl.store(row_ptrs[:, None] + cols[None, :], grad.to(logits_ptr.dtype.element_ty), mask=mask)


# The widest slice of a chunk's row one program reads at a time.
MAX_BLOCK = 4096


@launch_sizes
def _block(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK, BLOCK_M, num_warps): a program sweeps BLOCK_M rows of a chunk BLOCK columns at a time, about
    MAX_BLOCK elements a step (one row a program for the wide chunks of an LLM, many for narrow ones)."""
    block = min(triton.next_power_of_2(n_cols), MAX_BLOCK)
    block_m = max(1, MAX_BLOCK // block)
    return block, block_m, num_warps(block * block_m)


def _flags(label_smoothing: float, softcap: Optional[float], z_loss: float) -> dict:
    return {"SMOOTHING": label_smoothing > 0.0, "SOFTCAP": softcap is not None, "Z_LOSS": z_loss > 0.0}


def fold(logits, target, state, row_loss, start: int, vocab_size: int, options: tuple, first: bool, last: bool):
    """The forward kernel on one chunk's (rows, cols) logits, the vocabulary's columns from ``start``: folds them
    into the rows' ``state`` (m, d, the smoothing sums, the target's logit) and after the ``last`` chunk writes the
    rows' losses. ``options``: (ignore_index, label_smoothing, softcap, z_loss)."""
    n_rows, n_cols = logits.shape
    ignore_index, label_smoothing, softcap, z_loss = options
    block, block_m, warps = _block(n_cols)
    launch(
        _linear_cross_entropy_forward_kernel,
        (cdiv(n_rows, block_m),),
        logits,
        logits.stride(0),
        target,
        state,
        row_loss,
        n_rows,
        n_cols,
        start,
        vocab_size,
        ignore_index,
        label_smoothing,
        softcap if softcap is not None else 1.0,
        z_loss,
        FIRST=first,
        LAST=last,
        BLOCK=block,
        BLOCK_M=block_m,
        num_warps=warps,
        **_flags(label_smoothing, softcap, z_loss),
    )


def overwrite_with_gradient(
    logits, target, state, grad_output, grad_output_stride: int, n_valid, start: int, vocab_size: int, options: tuple
) -> None:
    """The backward kernel on one chunk's (rows, cols) logits: overwrites them with their gradient, from the rows'
    final ``state``, ``grad_output`` (a scalar when its stride is 0) and, for "mean", the ``n_valid`` count."""
    n_rows, n_cols = logits.shape
    ignore_index, label_smoothing, softcap, z_loss = options
    block, block_m, warps = _block(n_cols)
    mean = n_valid.numel() > 0
    launch(
        _linear_cross_entropy_backward_kernel,
        (cdiv(n_rows, block_m),),
        logits,
        logits.stride(0),
        target,
        state,
        grad_output,
        grad_output_stride,
        n_valid if mean else state,
        n_rows,
        n_cols,
        start,
        vocab_size,
        ignore_index,
        label_smoothing,
        softcap if softcap is not None else 1.0,
        z_loss,
        MEAN=mean,
        BLOCK=block,
        BLOCK_M=block_m,
        num_warps=warps,
        **_flags(label_smoothing, softcap, z_loss),
    )
