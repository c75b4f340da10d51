"""Cross-entropy over (N, C) logits whose gradient is computed in the forward.

The forward kernel takes one row per program: a first sweep over the row keeps a running max m, the running sum d
of ``exp(x - m)`` (online softmax) and the running sum of ``x - x_target`` (for label smoothing); a second sweep
writes ``softmax - smoothed one-hot`` (already scaled for the reduction) to a gradient buffer, so the probabilities
are never stored. The backward only multiplies that buffer by ``grad_output``, in place, and hands it on as the
logits' gradient: one (N, C) buffer beyond the logits in all (so a graph kept with ``retain_graph=True`` cannot be
run backward twice). The row is read twice (the second time mostly from L2) and the gradient written once, in the
logits' dtype: no (N, C) fp32 temporary, no log-softmax.

With ``overwrite_logits=True`` the gradient buffer is the logits themselves, as in Liger-Kernel: each row's
gradient is written over the row once both sweeps have read it, and the memory beyond the inputs is O(N). That is
for logits nothing else reads afterwards (a linear layer's output: its backward needs its input and weight, not its
output); the logits' version counter is bumped, so an op that saved them for its backward raises torch's
"modified by an inplace operation" error instead of computing a gradient from overwritten values.

Only differences of logits are formed: the loss is ``(m - x_target) + log(d)`` and the softmax ``exp(x - m) / d``.
``lse = m + log(d)`` with x subtracted afterwards would keep only fp32's resolution at the logits' magnitude
(1e-3 near 1e4), which a large common offset, harmless to the softmax, would turn into 1e-4 relative loss errors.

Semantics are ``torch.nn.functional.cross_entropy`` without class weights: ``ignore_index`` rows add 0 to the loss
and get a zero gradient, ``"mean"`` divides by the number of rows not ignored (NaN when all are, as in torch), and
label smoothing mixes in the uniform distribution over the C classes. Targets must lie in ``[0, C)`` or equal
``ignore_index``; unlike torch, the kernel does not check (that would cost a device sync per step).
"""

import torch
import triton
import triton.language as tl

from fabriclite.kernels._common import as_rows, check_dtypes, launch, num_warps

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
    n_valid_ptr,
    n_cols,
    ignore_index,
    label_smoothing,
    MEAN: tl.constexpr,
    SMOOTHING: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # int64 before multiplying: tokens x vocab reaches 2**31 at 16384 x 131072, sooner with a padded row stride.
    row = tl.program_id(0).to(tl.int64)
    logits_ptr += row * logits_row_stride
    grad_ptr += row * grad_row_stride
    target = tl.load(target_ptr + row)

    if target == ignore_index:
        tl.store(loss_ptr + row, 0.0)
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

    # Sweep 1: running max m, running sum d of exp(x - m), running sum of x - ref.
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

    # -log p_target = lse - x_target, and with smoothing eps/C * sum_c -log p_c = eps * (lse - mean(x)).
    loss = (m - x_target) + log_d
    if SMOOTHING:
        smooth = (m - ref) + log_d - sum_x / n_cols
        loss = (1.0 - label_smoothing) * loss + label_smoothing * smooth
    tl.store(loss_ptr + row, loss)

    if COMPUTE_GRAD:
        scale = 1.0
        if MEAN:
            scale = 1.0 / tl.load(n_valid_ptr)
        # Sweep 2: d loss / d x_c = p_c - (1 - eps) [c == target] - eps / C.
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
    grad_in_ptr,
    grad_ptr,
    grad_row_stride,
    grad_output_ptr,
    grad_output_stride,
    n_cols,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    grad_in_ptr += row * grad_row_stride
    grad_ptr += row * grad_row_stride
    # A scalar grad_output ("mean", "sum") has stride 0: every row reads the same element.
    scale = tl.load(grad_output_ptr + row * grad_output_stride).to(tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        grad = tl.load(grad_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(grad_in_ptr + cols, (grad * scale).to(grad_in_ptr.dtype.element_ty), mask=mask)


def _block(n_cols: int) -> int:
    return min(triton.next_power_of_2(n_cols), MAX_BLOCK)


def _forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    compute_grad: bool,
    overwrite_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss and the logits' gradient for grad_output 1: a new buffer, or the logits themselves (their rows made
    contiguous first) when ``overwrite_logits``."""
    n_rows, n_cols = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    target = target.contiguous()
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    if overwrite_logits:
        grad = logits
    else:
        grad = torch.empty((n_rows, n_cols) if compute_grad else (0,), dtype=logits.dtype, device=logits.device)
    # Counted on the device and read by the kernel: no host sync for the mean's denominator.
    n_valid = (target != ignore_index).sum().to(torch.float32) if reduction == "mean" else row_loss
    block = _block(n_cols)
    if n_rows > 0:
        launch(
            _cross_entropy_forward_kernel,
            (n_rows,),
            logits,
            logits.stride(0),
            grad,
            grad.stride(0) if compute_grad else n_cols,
            target,
            row_loss,
            n_valid,
            n_cols,
            ignore_index,
            label_smoothing,
            MEAN=reduction == "mean",
            SMOOTHING=label_smoothing > 0.0,
            COMPUTE_GRAD=compute_grad,
            BLOCK=block,
            num_warps=num_warps(block),
        )
    if reduction == "none":
        loss = row_loss.to(logits.dtype)
    elif reduction == "sum":
        loss = row_loss.sum().to(logits.dtype)
    else:
        loss = (row_loss.sum() / n_valid).to(logits.dtype)
    return loss, grad


def _scale_in_place(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    """``grad *= grad_output`` row by row, in place: the backward needs no second (N, C) buffer."""
    n_rows, n_cols = grad.shape
    # (N,) for "none", () otherwise; an expanded (N,) gradient keeps its stride 0.
    grad_output = as_rows(grad_output, 1) if grad_output.dim() else grad_output
    stride = grad_output.stride(0) if grad_output.dim() else 0
    block = _block(n_cols)
    if n_rows > 0:
        launch(
            _cross_entropy_backward_kernel,
            (n_rows,),
            grad,  # read and written by the same program, element by element
            grad,
            grad.stride(0),
            grad_output,
            stride,
            n_cols,
            BLOCK=block,
            num_warps=num_warps(block),
        )


# ---------------------------------------------------------------------- torch.library registration
@torch.library.custom_op("fabriclite::cross_entropy", mutates_args=())
def _cross_entropy_op(
    logits: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns the loss and d(loss)/d(logits) for grad_output 1 (an empty tensor when compute_grad is False)."""
    return _forward(logits, target, ignore_index, label_smoothing, reduction, compute_grad)


@_cross_entropy_op.register_fake
def _(logits, target, ignore_index, label_smoothing, reduction, compute_grad):
    loss = logits.new_empty((logits.shape[0],) if reduction == "none" else ())
    grad = logits.new_empty(logits.shape if compute_grad else (0,))
    return loss, grad


@torch.library.custom_op("fabriclite::cross_entropy_scale_", mutates_args=("grad",))
def _cross_entropy_scale_op(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    _scale_in_place(grad, grad_output)


@torch.library.custom_op("fabriclite::cross_entropy_backward", mutates_args=())
def _cross_entropy_backward_op(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    # What a traced graph (torch.compile) calls: out of place, since functionalization would copy anyway and
    # the compiler plans the buffers itself.
    grad_in = grad.clone(memory_format=torch.contiguous_format)
    _scale_in_place(grad_in, grad_output)
    return grad_in


@_cross_entropy_backward_op.register_fake
def _(grad, grad_output):
    return torch.empty_like(grad, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(output[1])
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)  # no (N, C) zeros for the gradient output, which nothing differentiates


def _backward_formula(ctx, grad_loss, _grad_of_grad):
    (grad,) = ctx.saved_tensors
    if grad.dim() == 1:  # the (0,) placeholder
        raise RuntimeError("fabriclite::cross_entropy ran with compute_grad=False; call it through cross_entropy().")
    # The saved gradient becomes the logits' gradient in place: one (N, C) buffer in all, as Liger-Kernel does. The
    # in-place op bumps its version, so a second backward through a retained graph raises torch's "modified by an
    # inplace operation" error instead of scaling twice.
    if type(grad) is not torch.Tensor:  # traced (FakeTensor, FunctionalTensor): the out-of-place op
        return torch.ops.fabriclite.cross_entropy_backward(grad, grad_loss), None, None, None, None, None
    torch.ops.fabriclite.cross_entropy_scale_(grad, grad_loss)
    return grad, None, None, None, None, None


_cross_entropy_op.register_autograd(_backward_formula, setup_context=_setup_context)


class _CrossEntropyOverwritingLogits(torch.autograd.Function):
    """The eager path of ``overwrite_logits=True``. A custom op may not both mutate an input and have an autograd
    formula, so this is a plain autograd Function; traced code takes the functional op instead."""

    @staticmethod
    def forward(ctx, logits, target, ignore_index, label_smoothing, reduction):
        loss, grad = _forward(logits, target, ignore_index, label_smoothing, reduction, True, overwrite_logits=True)
        # The kernel wrote through a pointer, which autograd cannot see: bump the version so that any other op that
        # saved these logits for its backward fails loudly rather than reading their gradient as their values.
        torch.autograd.graph.increment_version(logits)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        _scale_in_place(grad, grad_loss)
        torch.autograd.graph.increment_version(grad)  # a second backward through a retained graph raises
        return grad, None, None, None, None


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

    ``overwrite_logits=True`` writes the gradient over the logits (their values are lost; no (N, C) buffer is made)
    when they require grad, for logits that nothing else reads afterwards, such as a linear layer's output. Under
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
    compute_grad = logits.requires_grad and torch.is_grad_enabled()
    if overwrite_logits and compute_grad and not torch.compiler.is_compiling():
        return _CrossEntropyOverwritingLogits.apply(logits, target, ignore_index, float(label_smoothing), reduction)
    loss, _ = torch.ops.fabriclite.cross_entropy(
        logits, target, ignore_index, float(label_smoothing), reduction, compute_grad
    )
    return loss


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
