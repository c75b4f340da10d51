"""Cross-entropy over (N, C) logits: one pass over the logits in the forward, one in the backward.

The forward kernel takes one row per program and sweeps it once, keeping a running max m, the running sum d of
``exp(x - m)`` (online softmax) and the running sum of ``x - x_target`` (for label smoothing); it writes the row's
loss and saves m and d (two fp32 per row). The backward kernel sweeps the row once more and writes ``(softmax -
smoothed one-hot) * grad_output`` (divided by the mean's denominator), ``softmax = exp(x - m) / d``, so the
probabilities are never stored: the logits are read twice and their gradient written once, in the logits' dtype, with
no (N, C) fp32 temporary and no log-softmax. Beyond the inputs that is the gradient alone (torch eager: the
log-softmax, its gradient and the logits' gradient). In a model, where the logits would otherwise be freed after the
loss, the forward keeps them for the backward, so the backward's peak holds two logits-sized buffers (the logits
and their gradient; eager holds three); ``overwrite_logits=True`` brings that to one.

With ``overwrite_logits=True`` the backward writes the gradient over the logits themselves, as Liger-Kernel does in
its forward, and the memory beyond the inputs is O(N). That is for logits nothing else reads afterwards (a linear
layer's output: its backward needs its input and weight, not its output); the logits' version counter is bumped
after the write, so an op that saved them for its backward raises torch's "modified by an inplace operation" error
instead of computing a gradient from overwritten values, and so does a second backward through a retained graph.

Only differences of logits are formed: the loss is ``(m - x_target) + log(d)`` and the softmax ``exp(x - m) / d``.
``lse = m + log(d)`` with x subtracted afterwards would keep only fp32's resolution at the logits' magnitude
(1e-3 near 1e4), which a large common offset, harmless to the softmax, would turn into 1e-4 relative loss errors.

Semantics are ``torch.nn.functional.cross_entropy`` without class weights: ``ignore_index`` rows add 0 to the loss
and get a zero gradient, ``"mean"`` divides by the number of rows not ignored (NaN when all are, as in torch), and
label smoothing mixes in the uniform distribution over the C classes. Targets must lie in ``[0, C)`` or equal
``ignore_index``; unlike torch, the kernel does not check (that would cost a device sync per step).

The forward kernel can also write the gradient for grad_output 1 in the same launch (``COMPUTE_GRAD``, a second
sweep): ``linear_cross_entropy`` does, over each chunk's logits.
"""

import torch
import triton
import triton.language as tl

from fabriclite.kernels._common import as_rows, cast, check_dtypes, launch, launch_sizes, library_op, num_warps

# The widest slice of a row one program reads at a time; a wider row is swept in blocks of this many logits.
MAX_BLOCK = 8192
_REDUCTIONS = ("mean", "sum", "none")


@triton.jit
def _cross_entropy_forward_kernel(
    logits_ptr,
    logits_row_stride,
    grad_ptr,
    grad_row_stride,
    target_ptr,
    loss_ptr,
    stats_ptr,
    n_valid_ptr,
    n_rows,
    n_cols,
    ignore_index,
    label_smoothing,
    MEAN: tl.constexpr,
    SMOOTHING: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # fp32 however it is launched: Inductor passes a Python float as fp64 (Triton's JIT as fp32).
    label_smoothing = tl.cast(label_smoothing, tl.float32)
    # int64 before multiplying: tokens x vocab reaches 2**31 at 16384 x 131072, sooner with a padded row stride.
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_row_stride
    grad_ptr += row * grad_row_stride
    target = tl.load(target_ptr + row)

    if target == ignore_index:
        tl.store(loss_ptr + row, 0.0)
        tl.store(stats_ptr + row, 0.0)  # never read; written so that every output is defined
        tl.store(stats_ptr + n_rows + row, 1.0)
        if COMPUTE_GRAD:
            zeros = tl.zeros((BLOCK,), dtype=grad_ptr.dtype.element_ty)
            for start in range(0, n_cols, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                tl.store(grad_ptr + cols, zeros, mask=cols < n_cols)
        return

    x_target = tl.load(logits_ptr + target).to(tl.float32)
    # The smoothing term sums x - ref, not x: values near 0 rather than a sum near C * x. ref is x_target unless
    # that is -inf (a masked target class, whose loss is inf anyway), where x - x_target would give inf - inf.
    ref = tl.where(x_target == float("-inf"), 0.0, x_target)

    # The sweep: running max m, running sum d of exp(x - m), running sum of x - ref.
    m = float("-inf")
    d = 0.0
    sum_x = 0.0
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(logits_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        # A block of -inf logits (a masked vocabulary) leaves m_new at -inf; shifting by 0 then keeps exp() at 0
        # instead of exp(-inf + inf) = NaN.
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        d = d * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        if SMOOTHING:
            sum_x += tl.sum(tl.where(mask, x - ref, 0.0), axis=0)
        m = m_new
    log_d = tl.log(d)
    tl.store(stats_ptr + row, m)
    tl.store(stats_ptr + n_rows + row, d)

    # -log p_target = lse - x_target, and with smoothing eps/C * sum_c -log p_c = eps * (lse - mean(x)).
    loss = (m - x_target) + log_d
    if SMOOTHING:
        smooth = (m - ref) + log_d - sum_x / n_cols
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
    tl.store(loss_ptr + row, loss)

    if COMPUTE_GRAD:
        scale = 1.0
        if MEAN:
            scale = 1.0 / tl.load(n_valid_ptr).to(tl.float32)
        _write_gradient(logits_ptr, grad_ptr, target, m, d, scale, n_cols, label_smoothing, SMOOTHING, BLOCK)


@triton.jit
def _write_gradient(
    logits_ptr, grad_ptr, target, m, d, scale, n_cols, label_smoothing, SMOOTHING: tl.constexpr, BLOCK: tl.constexpr
):
    """One sweep over a row: d loss / d x_c = (p_c - (1 - eps) [c == target] - eps / C) * scale. Each element is
    read before it is written, by the same program, so grad_ptr may be logits_ptr."""
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(logits_ptr + cols, mask=mask, other=float("-inf")).to(tl.float32)
        grad = tl.exp(x - m) / d
        if SMOOTHING:
            grad = grad - label_smoothing / n_cols
            grad = tl.where(cols == target, grad - (1.0 - label_smoothing), grad)
        else:
            grad = tl.where(cols == target, grad - 1.0, grad)
        tl.store(grad_ptr + cols, (grad * scale).to(grad_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _cross_entropy_backward_kernel(
    grad_ptr,
    grad_row_stride,
    logits_ptr,
    logits_row_stride,
    target_ptr,
    stats_ptr,
    n_valid_ptr,
    grad_output_ptr,
    grad_output_stride,
    n_rows,
    n_cols,
    ignore_index,
    label_smoothing,
    MEAN: tl.constexpr,
    SMOOTHING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # fp32 however it is launched: Inductor passes a Python float as fp64 (Triton's JIT as fp32).
    label_smoothing = tl.cast(label_smoothing, tl.float32)
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_row_stride
    grad_ptr += row * grad_row_stride
    target = tl.load(target_ptr + row)
    if target == ignore_index:
        zeros = tl.zeros((BLOCK,), dtype=grad_ptr.dtype.element_ty)
        for start in range(0, n_cols, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            tl.store(grad_ptr + cols, zeros, mask=cols < n_cols)
        return
    # A scalar grad_output ("mean", "sum") has stride 0: every row reads the same element.
    scale = tl.load(grad_output_ptr + row * grad_output_stride).to(tl.float32)
    if MEAN:
        scale = scale / tl.load(n_valid_ptr).to(tl.float32)
    m = tl.load(stats_ptr + row)
    d = tl.load(stats_ptr + n_rows + row)
    _write_gradient(logits_ptr, grad_ptr, target, m, d, scale, n_cols, label_smoothing, SMOOTHING, BLOCK)


@launch_sizes
def _block(n_cols: int, max_block: int) -> tuple[int, int]:
    """(BLOCK, num_warps) for rows of ``n_cols``, worked out once per width."""
    block = min(triton.next_power_of_2(n_cols), max_block)
    return block, num_warps(block)


def _forward(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, stats, n_valid): stats the rows' running max then their sums of exp (fp32), n_valid the number of
    rows not ignored for "mean" (an empty tensor otherwise). ``logits`` must have unit column stride."""
    n_rows, n_cols = logits.shape
    if not target.is_contiguous():
        target = target.contiguous()
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    stats = torch.empty(2 * n_rows, dtype=torch.float32, device=logits.device)
    # Counted on the device and read by the kernels: no host sync for the mean's denominator.
    n_valid = (target != ignore_index).sum() if reduction == "mean" else row_loss.new_empty(0)
    block, warps = _block(n_cols, MAX_BLOCK)
    if n_rows > 0:
        launch(
            _cross_entropy_forward_kernel,
            (n_rows,),
            logits,
            logits.stride(0),
            logits,  # no gradient written here
            logits.stride(0),
            target,
            row_loss,
            stats,
            n_valid if reduction == "mean" else row_loss,
            n_rows,
            n_cols,
            ignore_index,
            label_smoothing,
            MEAN=reduction == "mean",
            SMOOTHING=label_smoothing > 0.0,
            COMPUTE_GRAD=False,
            BLOCK=block,
            num_warps=warps,
        )
    return reduce(row_loss, n_valid, reduction, logits.dtype), stats, n_valid


def reduce(row_loss: torch.Tensor, n_valid: torch.Tensor, reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """The rows' fp32 losses reduced as ``reduction`` says ("mean": over the ``n_valid`` rows not ignored), in
    ``dtype``."""
    if reduction == "none":
        loss = row_loss
    elif reduction == "sum":
        loss = row_loss.sum()
    else:
        loss = row_loss.sum() / n_valid
    return cast(loss, dtype)


def _backward(
    grad_loss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    n_valid: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Writes the logits' gradient into ``out`` (which may be ``logits``: each element is read before it is
    overwritten) and returns it."""
    n_rows, n_cols = logits.shape
    # (N,) for "none", () otherwise; an expanded (N,) gradient keeps its stride 0.
    grad_output = as_rows(grad_loss, 1) if grad_loss.dim() else grad_loss
    stride = grad_output.stride(0) if grad_output.dim() else 0
    mean = n_valid.numel() > 0
    block, warps = _block(n_cols, MAX_BLOCK)
    if n_rows > 0:
        launch(
            _cross_entropy_backward_kernel,
            (n_rows,),
            out,
            out.stride(0),
            logits,
            logits.stride(0),
            target if target.is_contiguous() else target.contiguous(),
            stats,
            n_valid if mean else stats,
            grad_output,
            stride,
            n_rows,
            n_cols,
            ignore_index,
            label_smoothing,
            MEAN=mean,
            SMOOTHING=label_smoothing > 0.0,
            BLOCK=block,
            num_warps=warps,
        )
    return out


# ---------------------------------------------------------------------- eager: an autograd Function
class _CrossEntropyFunction(torch.autograd.Function):
    """Eager calls: the kernels launched directly, without the custom op's dispatch. With ``overwrite`` the backward
    writes the gradient over the logits; a custom op may not both mutate an input and have an autograd formula, so
    traced code takes the functional op instead."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, reduction, overwrite):
        loss, stats, n_valid = _forward(logits, target, ignore_index, label_smoothing, reduction)
        ctx.save_for_backward(logits, target, stats, n_valid)
        ctx.config = (ignore_index, label_smoothing, overwrite)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        logits, target, stats, n_valid = ctx.saved_tensors
        ignore_index, label_smoothing, overwrite = ctx.config
        out = logits if overwrite else torch.empty_like(logits, memory_format=torch.contiguous_format)
        grad = _backward(grad_loss, logits, target, stats, n_valid, ignore_index, label_smoothing, out)
        if overwrite:
            # The kernel wrote through a pointer, which autograd cannot see: bump the version so that another op
            # that saved these logits, or a second backward through a retained graph, fails loudly rather than
            # reading the gradient as the logits' values.
            torch.autograd.graph.increment_version(logits)
        return grad, None, None, None, None, None


# ---------------------------------------------------------------------- traced: torch.library registration
def _cross_entropy_op_fake(logits, target, ignore_index, label_smoothing, reduction):
    n_rows = logits.shape[0]
    loss = logits.new_empty((n_rows,) if reduction == "none" else ())
    stats = logits.new_empty(2 * n_rows, dtype=torch.float32)
    n_valid = target.new_empty(()) if reduction == "mean" else logits.new_empty(0, dtype=torch.float32)
    return loss, stats, n_valid


@library_op("fabriclite::cross_entropy", fake=_cross_entropy_op_fake)
def _cross_entropy_op(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, label_smoothing: float, reduction: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, stats, n_valid): what the backward op needs besides the logits and targets."""
    return _forward(logits, target, ignore_index, label_smoothing, reduction)


def _cross_entropy_backward_op_fake(grad_loss, logits, target, stats, n_valid, ignore_index, label_smoothing):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


@library_op("fabriclite::cross_entropy_backward", fake=_cross_entropy_backward_op_fake)
def _cross_entropy_backward_op(
    grad_loss: torch.Tensor,
    logits: torch.Tensor,
    target: torch.Tensor,
    stats: torch.Tensor,
    n_valid: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
) -> torch.Tensor:
    """The logits' gradient, a new tensor (the compiler plans the buffers itself)."""
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return _backward(grad_loss, logits, target, stats, n_valid, ignore_index, label_smoothing, out)


def _setup_context(ctx, inputs, output) -> None:
    logits, target, ignore_index, label_smoothing, _ = inputs
    _, stats, n_valid = output
    ctx.save_for_backward(logits, target, stats, n_valid)
    ctx.config = (ignore_index, label_smoothing)
    ctx.mark_non_differentiable(stats, n_valid)


def _backward_formula(ctx, grad_loss, _grad_stats, _grad_n_valid):
    logits, target, stats, n_valid = ctx.saved_tensors
    grad = torch.ops.fabriclite.cross_entropy_backward(grad_loss, logits, target, stats, n_valid, *ctx.config)
    return grad, None, None, None, None


_cross_entropy_op.register_autograd(_backward_formula, setup_context=_setup_context)


# ---------------------------------------------------------------------- public API
def cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    overwrite_logits: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy`` for (N, C) logits and (N,) class indices, with the gradient computed in the forward.

    ``overwrite_logits=True`` has the backward write the gradient over the logits (their values are lost; no (N, C)
    buffer is made), for logits that nothing else reads afterwards, such as a linear layer's output. Under
    ``torch.compile`` it is ignored: the compiler plans the buffers.

    Usage: ``loss = cross_entropy(logits.view(-1, vocab), labels.view(-1), ignore_index=-100)``.
    """
    if logits.dim() != 2 or target.shape != logits.shape[:1]:
        raise ValueError(
            f"cross_entropy expects (N, C) logits and (N,) targets, got {tuple(logits.shape)} and "
            f"{tuple(target.shape)}; flatten the leading dimensions with .view(-1, C) and .view(-1)."
        )
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported; use one of {_REDUCTIONS}.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must lie in [0, 1].")
    check_dtypes("cross_entropy", "torch.nn.functional.cross_entropy", logits)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # the kernels read a row as one run of memory
    if torch.compiler.is_compiling():
        return torch.ops.fabriclite.cross_entropy(logits, target, ignore_index, float(label_smoothing), reduction)[0]
    return _CrossEntropyFunction.apply(
        logits, target, ignore_index, float(label_smoothing), reduction, bool(overwrite_logits)
    )


class CrossEntropyLoss(torch.nn.Module):
    """``nn.CrossEntropyLoss`` (no class weights) on the fused kernel.

    Usage: ``loss = CrossEntropyLoss(ignore_index=-100)(logits, target)``.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        overwrite_logits: bool = False,
    ) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.overwrite_logits = overwrite_logits

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(
            logits, target, self.ignore_index, self.label_smoothing, self.reduction, self.overwrite_logits
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, label_smoothing={self.label_smoothing}"
            + (", overwrite_logits=True" if self.overwrite_logits else "")
        )


__all__ = ["CrossEntropyLoss", "cross_entropy"]
