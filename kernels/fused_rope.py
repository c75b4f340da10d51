"""Rotary position embedding in Llama's rotate-half layout: ``x * cos + rotate_half(x) * sin`` with
``rotate_half(x) = cat(-x2, x1)`` (x1, x2 the two halves of the head dimension), for queries and keys.

q and k are (B, T, H, D), k possibly with fewer heads (grouped-query attention), in any strides; cos and sin are
(T, D), or (B, T, D) when positions differ per sequence. Forward: one program per (sequence, position) and tensor
(q, then k in a second launch), all heads of that token in one (heads, D / 2) tile; cos and sin are read once per
token, the rotation is computed in fp32 and stored once in the input's dtype. Nothing is saved for the backward
but cos and sin: the map is linear, and its gradient is the transposed rotation, ``dx1 = dy1 * cos1 + dy2 * sin2``,
``dx2 = dy2 * cos2 - dy1 * sin1`` (the rotation by -sin when the halves of cos and sin agree, as they do in
Llama). cos and sin are constants here (Llama computes them from positions); a cos or sin that requires grad is
refused rather than given a silent zero gradient.
"""

import torch
import triton
import triton.language as tl

from fabriclite.kernels._common import check_dtypes, launch, launch_sizes, library_op, num_warps


@triton.jit
def _rope_forward_kernel(
    x_ptr,
    x_batch_stride,
    x_row_stride,
    x_head_stride,
    x_col_stride,
    y_ptr,
    cos_ptr,
    sin_ptr,
    cos_batch_stride,
    seq_len,
    n_heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # batch * seq_len + position
    batch = token // seq_len
    position = token % seq_len
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    col_mask = cols < half
    mask = (heads < n_heads) & col_mask
    # cos and sin are contiguous (T, D) or (B, T, D); a batch stride of 0 shares one table across sequences.
    table = batch * cos_batch_stride + position * (2 * half) + cols
    cos1 = tl.load(cos_ptr + table, mask=col_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + half, mask=col_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=col_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + half, mask=col_mask, other=0.0).to(tl.float32)
    x_first = x_ptr + batch * x_batch_stride + position * x_row_stride + heads * x_head_stride + cols * x_col_stride
    x1 = tl.load(x_first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_first + half * x_col_stride, mask=mask, other=0.0).to(tl.float32)
    y1 = x1 * cos1 - x2 * sin1
    y2 = x2 * cos2 + x1 * sin2
    y_first = y_ptr + token * n_heads * (2 * half) + heads * (2 * half) + cols  # y is contiguous (B, T, H, D)
    tl.store(y_first, y1.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(y_first + half, y2.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_backward_kernel(
    dy_ptr,
    dy_batch_stride,
    dy_row_stride,
    dy_head_stride,
    dy_col_stride,
    dx_ptr,
    cos_ptr,
    sin_ptr,
    cos_batch_stride,
    seq_len,
    n_heads,
    half,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    batch = token // seq_len
    position = token % seq_len
    heads = tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, BLOCK_HALF)[None, :]
    col_mask = cols < half
    mask = (heads < n_heads) & col_mask
    table = batch * cos_batch_stride + position * (2 * half) + cols
    cos1 = tl.load(cos_ptr + table, mask=col_mask, other=0.0).to(tl.float32)
    cos2 = tl.load(cos_ptr + table + half, mask=col_mask, other=0.0).to(tl.float32)
    sin1 = tl.load(sin_ptr + table, mask=col_mask, other=0.0).to(tl.float32)
    sin2 = tl.load(sin_ptr + table + half, mask=col_mask, other=0.0).to(tl.float32)
    # dy may be an expanded gradient (strides 0), hence every stride.
    dy_first = (
        dy_ptr + batch * dy_batch_stride + position * dy_row_stride + heads * dy_head_stride + cols * dy_col_stride
    )
    dy1 = tl.load(dy_first, mask=mask, other=0.0).to(tl.float32)
    dy2 = tl.load(dy_first + half * dy_col_stride, mask=mask, other=0.0).to(tl.float32)
    # The transpose of the forward's [[cos1, -sin1], [sin2, cos2]] acting on the halves.
    dx1 = dy1 * cos1 + dy2 * sin2
    dx2 = dy2 * cos2 - dy1 * sin1
    dx_first = dx_ptr + token * n_heads * (2 * half) + heads * (2 * half) + cols
    tl.store(dx_first, dx1.to(dx_ptr.dtype.element_ty), mask=mask)
    tl.store(dx_first + half, dx2.to(dx_ptr.dtype.element_ty), mask=mask)


@launch_sizes
def _blocks(n_heads: int, half: int) -> tuple[int, int, int]:
    """(BLOCK_H, BLOCK_HALF, num_warps), worked out once per head count and head size."""
    block_h, block_half = triton.next_power_of_2(n_heads), triton.next_power_of_2(half)
    return block_h, block_half, num_warps(block_h * block_half)


def _rotate(kernel, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``kernel`` (the forward or the backward) over a (B, T, H, D) tensor in any strides; returns a contiguous
    tensor of x's shape and dtype."""
    batch, seq_len, n_heads, head_dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    # cos and sin are (T, D) or (B, T, D) tables, small next to q and k: contiguous copies cost little.
    if not cos.is_contiguous():
        cos = cos.contiguous()
    if not sin.is_contiguous():
        sin = sin.contiguous()
    cos_batch_stride = cos.stride(0) if cos.dim() == 3 and cos.shape[0] > 1 else 0
    block_h, block_half, warps = _blocks(n_heads, head_dim // 2)
    if x.numel() > 0:
        launch(
            kernel,
            (batch * seq_len,),
            x,
            *x.stride(),
            out,
            cos,
            sin,
            cos_batch_stride,
            seq_len,
            n_heads,
            head_dim // 2,
            BLOCK_H=block_h,
            BLOCK_HALF=block_half,
            num_warps=warps,
        )
    return out


# ---------------------------------------------------------------------- eager: an autograd Function
class _RopeFunction(torch.autograd.Function):
    """Eager calls: the kernels launched directly, without the custom op's dispatch."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _rotate(_rope_forward_kernel, q, cos, sin), _rotate(_rope_forward_kernel, k, cos, sin)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dq_rot, dk_rot):
        cos, sin = ctx.saved_tensors
        dq, dk = _rotate(_rope_backward_kernel, dq_rot, cos, sin), _rotate(_rope_backward_kernel, dk_rot, cos, sin)
        return dq, dk, None, None


# ---------------------------------------------------------------------- traced: torch.library registration
def _rotated_fake(x: torch.Tensor, y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return x.new_empty(x.shape), y.new_empty(y.shape)


@library_op("fabriclite::rope", fake=_rotated_fake)
def _rope_op(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (q_rot, k_rot), contiguous."""
    return _rotate(_rope_forward_kernel, q, cos, sin), _rotate(_rope_forward_kernel, k, cos, sin)


@library_op("fabriclite::rope_backward", fake=_rotated_fake)
def _rope_backward_op(
    dq_rot: torch.Tensor, dk_rot: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dq, dk), contiguous."""
    return _rotate(_rope_backward_kernel, dq_rot, cos, sin), _rotate(_rope_backward_kernel, dk_rot, cos, sin)


def _setup_context(ctx, inputs, output) -> None:
    _, _, cos, sin = inputs
    ctx.save_for_backward(cos, sin)


def _backward_formula(ctx, dq_rot, dk_rot):
    cos, sin = ctx.saved_tensors
    dq, dk = torch.ops.fabriclite.rope_backward(dq_rot, dk_rot, cos, sin)
    return dq, dk, None, None


_rope_op.register_autograd(_backward_formula, setup_context=_setup_context)


# ---------------------------------------------------------------------- public API
def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin)`` for q, k of shape (B, T, H, D) (k may
    have fewer heads) and cos, sin of shape (T, D) or (B, T, D), Llama's rotate-half layout. The rotation is
    computed in fp32 and the results keep q's and k's dtypes (contiguous, whatever the inputs' strides); cos and
    sin are constants (no gradient).

    Usage: ``q, k = rope(q.view(B, T, H, D), k.view(B, T, H_kv, D), cos[:T], sin[:T])``.
    """
    if q.dim() != 4 or k.dim() != 4 or q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3] or q.shape[3] % 2:
        raise ValueError(
            "rope needs q and k of shape (B, T, H, D) with the same B, T and an even D (k may have fewer heads); "
            f"got q {tuple(q.shape)} and k {tuple(k.shape)}."
        )
    batch, seq_len, _, head_dim = q.shape
    tables = [(seq_len, head_dim), (1, seq_len, head_dim), (batch, seq_len, head_dim)]
    if cos.shape != sin.shape or tuple(cos.shape) not in tables:
        raise ValueError(
            f"rope needs cos and sin of one shape, (T, D) = {tables[0]} or (B, T, D) = {tables[2]}; got cos "
            f"{tuple(cos.shape)} and sin {tuple(sin.shape)}. Slice the tables to the sequence: cos[:T], sin[:T]."
        )
    if cos.requires_grad or sin.requires_grad:
        raise ValueError(
            "rope takes cos and sin as constants and computes no gradient for them; got a cos or sin that requires "
            "grad. Pass cos.detach() and sin.detach(), or use the torch formula to train through the tables."
        )
    check_dtypes("rope", "q * cos + rotate_half(q) * sin", q, k, cos, sin)
    if torch.compiler.is_compiling():
        return torch.ops.fabriclite.rope(q, k, cos, sin)
    return _RopeFunction.apply(q, k, cos, sin)


__all__ = ["rope"]
