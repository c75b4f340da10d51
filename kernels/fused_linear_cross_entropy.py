"""Cross-entropy of a linear layer's output, ``F.cross_entropy(hidden @ weight.T + bias, target)``, computed in
chunks of tokens so the (N, V) logits never exist at once: a language model's output layer, where V (the
vocabulary, 32k to 256k) dwarfs H (the width) and the logits and their gradient are the largest tensors of a step.

The forward takes the tokens a chunk at a time. Per chunk it computes the chunk's logits with torch's matmul, runs
the cross-entropy forward kernel of ``fused_cross_entropy.py`` on them, which writes the loss of each row and, in
place over the logits, their gradient (``softmax - one-hot``, already divided by the mean's denominator), and then
turns that gradient into the chunk's rows of ``grad_hidden = grad_logits @ W`` and adds ``grad_logits.T @ chunk``
(and the column sums, for the bias) to fp32 accumulators of the weight's (and bias's) gradient. The backward only
multiplies those stored gradients by ``grad_output`` (a copy of each). Memory beyond the inputs: the gradients,
the weight's first in an fp32 accumulator (4 bytes x V x H, cast to the weight's dtype at the end), and one
chunk's logits, never N x V. ``softcap`` adds a second chunk buffer, ``z_loss`` an fp32 copy, and in bf16 or fp16
either (or the backward of ``"none"``) makes the chunk's buffers fp32, so that the gradient is rounded to bf16 once,
as torch rounds it. This is Liger-Kernel's fused linear cross-entropy; Apple's Cut Cross-Entropy goes further and
never writes even a chunk's logits.

Why the weight's gradient has an fp32 accumulator when the weight is bf16 (with fp32 master weights, as under
bf16-mixed, the accumulator is the gradient itself and costs nothing extra): Liger-Kernel adds each chunk's part
into a bf16 buffer, which saves that memory but rounds the sum once per chunk. With torch's matmuls on the CPU (N =
8192, H = 512, V = 4096, bf16 inputs, float64 reference), torch's own bf16 weight gradient has a relative error of
1.7e-3; adding 8, 32 and 128 chunks in bf16 gives 3.5e-3, 6.5e-3 and 1.1e-2 (2.1x, 3.9x, 6.6x torch's), an fp32
accumulator 1.7e-3 at every count. So at Llama-3-8B's output layer (8192 tokens, H = 4096, V = 128256, all bf16) the
extra memory is about 2.9 GiB at its peak (the accumulator, then the cast), against about 5.9 GiB for eager
``F.cross_entropy(F.linear(...))`` (the logits' log-softmax and two gradients of their size): half, not the fifth
that bf16 accumulation would reach (by arithmetic; not yet measured on a GPU). Chunking the vocabulary instead of the
tokens would give both, the weight's gradient rounded once and an accumulator of N x H only, at the price of a
fourth logits-sized matmul (the log-normalizers first, then the gradients).

The chunk is ``ceil(N / ceil(V / H))`` rows, so that its logits take about as much memory as ``hidden`` (Liger's
rule): 256 rows for 8192 tokens of Llama-3-8B (H = 4096, V = 128256).

``reduction="none"`` returns a loss per row, and its gradient scales each row's logits gradient by its own
``grad_output`` before the rows are summed into the weight's gradient, which a stored sum cannot be rescaled to. So
for ``"none"`` the forward computes the losses only and the backward runs the chunks again with those scales: one
more logits matmul, the same memory.

``softcap`` (Gemma 2) caps the logits at ``softcap * tanh(logits / softcap)`` before the cross-entropy, and
``z_loss`` (PaLM) adds ``z_loss * logsumexp(logits) ** 2`` to the loss of every row not ignored, pulling the
log-normalizer towards 0. Both are computed with torch ops on the chunk (the kernel knows neither): the capped
logits' gradient is multiplied by ``1 - tanh ** 2``, and the z-loss adds ``2 * z_loss * lse * softmax``.
Semantics otherwise are those of ``fabriclite.kernels.cross_entropy``: no class weights, ``ignore_index`` rows add
0 to the loss and get no gradient, ``"mean"`` divides by the number of rows not ignored, targets are not checked.
"""

from typing import Optional

import torch
import torch.nn.functional as F
import triton

from fabriclite.kernels import fused_cross_entropy
from fabriclite.kernels._common import check_dtypes, launch

_REDUCTIONS = ("mean", "sum", "none")

# Rows per chunk; None picks ceil(N / ceil(V / H)). Tests lower it to run many chunks on small shapes.
CHUNK_ROWS: Optional[int] = None


def _chunk_rows(n_rows: int, hidden_size: int, vocab_size: int) -> int:
    """Rows whose (rows, V) logits take about as much memory as the (N, H) hidden states."""
    if CHUNK_ROWS is not None:
        return CHUNK_ROWS
    return max(1, triton.cdiv(n_rows, triton.cdiv(vocab_size, hidden_size)))


def _add_matmul(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fp32_out: bool) -> None:
    """``accumulator += a @ b`` with an fp32 accumulator and a, b in the compute dtype."""
    if a.dtype == accumulator.dtype:
        accumulator.addmm_(a, b)
    elif fp32_out:  # Ampere and newer: the GEMM accumulates into the fp32 tensor directly
        torch.addmm(accumulator, a, b, out_dtype=torch.float32, out=accumulator)
    else:  # one (V, H) temporary in the compute dtype, rounded once per chunk
        accumulator.add_(a @ b)


def _chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    mean: bool,
    softcap: Optional[float],
    z_loss: float,
    needs_grad: list[bool],
    row_scale: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The chunk loop of forward and backward alike.

    Returns (the fp32 loss of every row, the mean's denominator, and the gradients of hidden, weight and bias, each
    None unless ``needs_grad`` asks for it). The gradients are those of the mean (``mean=True``) or of the sum of
    the row losses, each row's term multiplied by ``row_scale[row]`` when given.
    """
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    want_hidden, want_weight, want_bias = needs_grad
    want_bias = want_bias and bias is not None
    compute_grad = want_hidden or want_weight or want_bias
    # The matmuls run in hidden's dtype; fp32 master weights (bf16 autocast) are cast once, as autocast does.
    weight_c = weight.to(dtype)
    bias_c = bias.to(dtype) if bias is not None else None

    row_loss = torch.empty(n_rows, dtype=torch.float32, device=device)
    # Counted on the device and read by the kernel: no host sync for the mean's denominator.
    n_valid = (target != ignore_index).sum().to(torch.float32)
    grad_hidden = torch.empty((n_rows, hidden_size), dtype=dtype, device=device) if want_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if want_weight else None
    grad_bias = torch.zeros(vocab_size, dtype=torch.float32, device=device) if want_bias else None
    # torch.addmm(..., out_dtype=) is CUDA-only and newer than our oldest supported torch.
    fp32_out = (
        device.type == "cuda"
        and hasattr(torch.ops.aten.addmm, "dtype_out")
        and torch.cuda.get_device_capability(device)[0] >= 8
    )
    block, warps = fused_cross_entropy._block(vocab_size, fused_cross_entropy.MAX_BLOCK)
    # The kernel rounds the logits' gradient once, to their dtype. What is done to it afterwards (the softcap's
    # derivative, the z-loss's term, a per-row scale) would round a bf16 gradient again, so those chunks are
    # computed in fp32 and rounded once at the end, as torch rounds its gradient once.
    in_fp32 = dtype != torch.float32 and (softcap is not None or z_loss > 0.0 or row_scale is not None)

    rows = _chunk_rows(n_rows, hidden_size, vocab_size)
    stats = torch.empty(2 * min(rows, n_rows), dtype=torch.float32, device=device)
    for start in range(0, n_rows, rows):
        end = min(start + rows, n_rows)
        chunk, chunk_target = hidden[start:end], target[start:end].contiguous()
        logits = F.linear(chunk, weight_c, bias_c)  # (rows, V), contiguous: the kernel overwrites it
        if in_fp32:
            logits = logits.float()
        tanh = None
        if softcap is not None:
            tanh = logits.div_(softcap).tanh_()
            logits = tanh * softcap

        if z_loss:
            valid = chunk_target != ignore_index
            # An fp32 copy of the logits: their logsumexp, then (for the gradient) their softmax in place.
            probs = logits.to(torch.float32, copy=True)
            lse = torch.logsumexp(probs, dim=-1)

        launch(
            fused_cross_entropy._cross_entropy_forward_kernel,
            (end - start,),
            logits,
            logits.stride(0),
            logits,  # the gradient overwrites the logits, row by row after reading them
            logits.stride(0),
            chunk_target,
            row_loss[start:end],
            stats,  # the rows' max and sum of exp, which nothing here reads again
            n_valid,
            end - start,
            vocab_size,
            ignore_index,
            label_smoothing,
            MEAN=mean,
            SMOOTHING=label_smoothing > 0.0,
            COMPUTE_GRAD=compute_grad,
            BLOCK=block,
            num_warps=warps,
        )
        if z_loss:
            row_loss[start:end] += torch.where(valid, z_loss * lse.square(), 0.0)
        if not compute_grad:
            continue

        grad_logits = logits
        if z_loss:
            # d(z_loss * lse ** 2) / d logits = 2 * z_loss * lse * softmax, scaled as the kernel scaled its part.
            coefficient = torch.where(valid, 2.0 * z_loss * lse, 0.0)
            if mean:
                coefficient = coefficient / n_valid
            grad_logits.add_(probs.sub_(lse[:, None]).exp_().mul_(coefficient[:, None]))
        if row_scale is not None:
            grad_logits.mul_(row_scale[start:end, None])
        if tanh is not None:
            grad_logits.mul_(tanh.square_().neg_().add_(1.0))  # d capped / d logits = 1 - tanh ** 2

        grad_logits = grad_logits.to(dtype)
        if want_hidden:
            torch.mm(grad_logits, weight_c, out=grad_hidden[start:end])
        if want_weight:
            _add_matmul(grad_weight, grad_logits.t(), chunk, fp32_out)
        if want_bias:
            grad_bias.add_(grad_logits.sum(dim=0, dtype=torch.float32))

    return (
        row_loss,
        n_valid,
        grad_hidden,
        grad_weight.to(weight.dtype) if grad_weight is not None else None,
        grad_bias.to(bias.dtype) if grad_bias is not None else None,
    )


# ---------------------------------------------------------------------- torch.library registration
@torch.library.custom_op("fabriclite::linear_cross_entropy", mutates_args=())
def _linear_cross_entropy_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    softcap: Optional[float],
    z_loss: float,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns the loss and, for "mean" and "sum", the gradients of hidden, weight and bias for grad_output 1 where
    ``needs_grad`` asks for them (empty tensors elsewhere, and always for "none", whose backward recomputes)."""
    if reduction == "none":
        needs_grad = [False, False, False]
    row_loss, n_valid, grad_hidden, grad_weight, grad_bias = _chunked(
        hidden, weight, target, bias, ignore_index, label_smoothing, reduction == "mean", softcap, z_loss, needs_grad
    )
    if reduction == "none":
        loss = row_loss.to(hidden.dtype)
    elif reduction == "sum":
        loss = row_loss.sum().to(hidden.dtype)
    else:
        loss = (row_loss.sum() / n_valid).to(hidden.dtype)
    empty = hidden.new_empty(0)
    return loss, *(grad if grad is not None else empty.clone() for grad in (grad_hidden, grad_weight, grad_bias))


def _fake_grads(hidden, weight, bias, needs_grad):
    want_hidden, want_weight, want_bias = needs_grad
    return (
        hidden.new_empty(hidden.shape) if want_hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if want_weight else hidden.new_empty(0),
        bias.new_empty(bias.shape) if want_bias and bias is not None else hidden.new_empty(0),
    )


@_linear_cross_entropy_op.register_fake
def _(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, z_loss, needs_grad):
    loss = hidden.new_empty((hidden.shape[0],) if reduction == "none" else ())
    if reduction == "none":
        needs_grad = [False, False, False]
    return loss, *_fake_grads(hidden, weight, bias, needs_grad)


@torch.library.custom_op("fabriclite::linear_cross_entropy_backward", mutates_args=())
def _linear_cross_entropy_backward_op(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    softcap: Optional[float],
    z_loss: float,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of hidden, weight and bias for reduction "none" and a per-row ``grad_loss``: the forward's
    chunks again, each row's logits gradient scaled by its ``grad_loss`` (empty tensors where not needed)."""
    *_, grad_hidden, grad_weight, grad_bias = _chunked(
        hidden, weight, target, bias, ignore_index, label_smoothing, False, softcap, z_loss, needs_grad, grad_loss
    )
    empty = hidden.new_empty(0)
    return tuple(grad if grad is not None else empty.clone() for grad in (grad_hidden, grad_weight, grad_bias))


@_linear_cross_entropy_backward_op.register_fake
def _(grad_loss, hidden, weight, target, bias, ignore_index, label_smoothing, softcap, z_loss, needs_grad):
    return _fake_grads(hidden, weight, bias, needs_grad)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, z_loss, needs_grad = inputs
    ctx.mark_non_differentiable(*output[1:])
    ctx.recompute = reduction == "none"
    if ctx.recompute:
        ctx.save_for_backward(hidden, weight, target, bias)
        ctx.arguments = (ignore_index, label_smoothing, softcap, z_loss)
    else:
        ctx.save_for_backward(*output[1:])
        ctx.computed = needs_grad


def _backward_formula(ctx, grad_loss, *_grads_of_grads):
    hidden_weight_bias = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3])
    if ctx.recompute:
        hidden, weight, target, bias = ctx.saved_tensors
        grads = torch.ops.fabriclite.linear_cross_entropy_backward(
            grad_loss, hidden, weight, target, bias, *ctx.arguments, list(hidden_weight_bias)
        )
    else:
        if any(need and not computed for need, computed in zip(hidden_weight_bias, ctx.computed)):
            raise RuntimeError(
                "fabriclite::linear_cross_entropy ran without the gradient that autograd now asks for (needs_grad "
                f"{ctx.computed}); call it through linear_cross_entropy(), which sets needs_grad from requires_grad."
            )
        grads = [grad * grad_loss for grad in ctx.saved_tensors]
    grad_hidden, grad_weight, grad_bias = (grad if need else None for grad, need in zip(grads, hidden_weight_bias))
    return grad_hidden, grad_weight, None, grad_bias, None, None, None, None, None, None


_linear_cross_entropy_op.register_autograd(_backward_formula, setup_context=_setup_context)


# ---------------------------------------------------------------------- public API
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor] = None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
    softcap: Optional[float] = None,
    z_loss: float = 0.0,
) -> torch.Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), target)`` for (N, H) hidden states, a (V, H) weight and
    (N,) class indices, without ever holding the (N, V) logits: computed in chunks of tokens, gradients included.

    ``softcap`` caps the logits at ``softcap * tanh(logits / softcap)`` first (Gemma 2); ``z_loss`` adds
    ``z_loss * logsumexp(logits) ** 2`` per row not ignored (PaLM). The matmuls run in ``hidden``'s dtype.

    Usage: ``loss = linear_cross_entropy(x.view(-1, width), model.lm_head.weight, labels.view(-1))``.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden.shape[1] or target.shape != hidden.shape[:1]:
        raise ValueError(
            "linear_cross_entropy expects (N, H) hidden states, a (V, H) weight and (N,) targets, got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)} and {tuple(target.shape)}; flatten the leading "
            "dimensions with hidden.view(-1, H) and target.view(-1)."
        )
    if bias is not None and bias.shape != weight.shape[:1]:
        raise ValueError(f"linear_cross_entropy expects a ({weight.shape[0]},) bias, got {tuple(bias.shape)}.")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported; use one of {_REDUCTIONS}.")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing={label_smoothing} must lie in [0, 1].")
    if softcap is not None and not softcap > 0.0:
        raise ValueError(f"softcap={softcap} must be positive (Gemma 2 uses 30.0), or None for no cap.")
    if not z_loss >= 0.0:
        raise ValueError(f"z_loss={z_loss} must be 0 (off) or positive (PaLM uses 1e-4).")
    check_dtypes(
        "linear_cross_entropy", "F.cross_entropy(F.linear(hidden, weight, bias), target)", hidden, weight, bias
    )
    grad_enabled = torch.is_grad_enabled()
    needs_grad = [grad_enabled and t is not None and t.requires_grad for t in (hidden, weight, bias)]
    loss, *_ = torch.ops.fabriclite.linear_cross_entropy(
        hidden,
        weight,
        target,
        bias,
        ignore_index,
        float(label_smoothing),
        reduction,
        float(softcap) if softcap is not None else None,
        float(z_loss),
        needs_grad,
    )
    return loss


class LinearCrossEntropyLoss(torch.nn.Module):
    """``linear_cross_entropy`` as a loss module; the output layer's weight (and bias) are passed to ``forward``.

    Usage: ``loss = LinearCrossEntropyLoss(ignore_index=-100)(x.view(-1, width), lm_head.weight, labels.view(-1))``.
    """

    def __init__(
        self,
        ignore_index: int = -100,
        reduction: str = "mean",
        label_smoothing: float = 0.0,
        softcap: Optional[float] = None,
        z_loss: float = 0.0,
    ) -> None:
        super().__init__()
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.softcap = softcap
        self.z_loss = z_loss

    def forward(
        self, hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, bias: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        return linear_cross_entropy(
            hidden,
            weight,
            target,
            bias,
            self.ignore_index,
            self.label_smoothing,
            self.reduction,
            self.softcap,
            self.z_loss,
        )

    def extra_repr(self) -> str:
        return (
            f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"label_smoothing={self.label_smoothing}, softcap={self.softcap}, z_loss={self.z_loss}"
        )


__all__ = ["LinearCrossEntropyLoss", "linear_cross_entropy"]
