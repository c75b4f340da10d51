"""Cross-entropy of a linear layer's output, ``F.cross_entropy(hidden @ weight.T + bias, target)``, computed in
chunks of the vocabulary so the (N, V) logits never exist at once: a language model's output layer, where V (the
vocabulary, 32k to 256k) dwarfs H (the width) and the logits and their gradient are the largest tensors of a step.

Forward: for each chunk of vocabulary rows of the weight, torch's matmul makes the chunk's (N, cols) logits and a
kernel folds them into a running max m and sum d of ``exp(x - m)`` per token (online softmax across chunks), picks
the target's logit when it lies in the chunk, and after the last chunk writes each token's loss. What is saved: the
inputs and two fp32 per token (m and d). Backward: the chunks again; each chunk's logits are recomputed, a kernel
overwrites them in place with their gradient (``(softmax - one-hot) * grad_output``, ``softmax = exp(x - m) / d``,
divided by the mean's denominator), and two matmuls turn that into the chunk's rows of the weight's gradient
(``grad_logits.T @ hidden``, summed over all N tokens inside one matmul, so each element is rounded once, in the
weight's dtype) and its part of ``grad_hidden = grad_logits @ W`` (added to an fp32 (N, H) accumulator, rounded
once at the end). One matmul more than eager (four logits-sized matmuls against three), for memory.

Memory beyond the inputs and outputs: one chunk's logits and the fp32 accumulator of hidden's gradient, 4 x N x H
bytes. At Llama-3-8B's output layer (N = 8192 tokens, H = 4096, V = 128256, all bf16) with chunks of 4096 columns:
the weight's gradient 1002 MiB, the accumulator 128 MiB, hidden's gradient 64 MiB, a chunk's logits 64 MiB, at most
about 1.2 GiB at the peak, against 6012 MiB for eager ``F.cross_entropy(F.linear(...))`` (by arithmetic; not yet
measured on a GPU). The chunk is ``max(H, 2**24 / N)`` columns (a multiple of 256), so its logits take about as much
memory as ``hidden`` and each matmul is large enough to run at full speed.

``softcap`` (Gemma 2) caps the logits at ``softcap * tanh(logits / softcap)`` before the cross-entropy, and
``z_loss`` (PaLM) adds ``z_loss * logsumexp(logits) ** 2`` to the loss of every row not ignored, pulling the
log-normalizer towards 0. Both are computed inside the kernels in fp32 (the capped logits' gradient is multiplied by
``1 - tanh ** 2``, and the z-loss adds ``2 * z_loss * lse * softmax``), so the gradient is rounded once. The label
smoothing term sums ``x - ref`` with ``ref`` the row's first logit, values near 0 rather than a sum near V * x.
Semantics otherwise are those of ``fabriclite.kernels.cross_entropy``: no class weights, ``ignore_index`` rows add
0 to the loss and get no gradient, ``"mean"`` divides by the number of rows not ignored, targets are not checked.

Cut Cross-Entropy (Wijmans et al., 2024) goes further and never writes even a chunk's logits to memory.

The other design, ``GRADIENT_IN_FORWARD`` (issue 40; off until a GPU run shows it faster): chunks of rows (tokens)
instead of vocabulary columns, as Liger-Kernel's fused linear cross-entropy does. A chunk's (rows, V) logits hold
whole rows, so one matmul makes them, the kernels turn them into the loss and then into their gradient in place, and
two matmuls make the chunk's rows of hidden's gradient and add its share to the weight's: three logits-sized matmuls
as in eager, all in the forward; the backward only scales the gradients by the loss's gradient. The price: the
weight's gradient is accumulated chunk by chunk (rounded once per chunk in a bf16 weight's dtype), the whole weight
is cast to hidden's dtype at once when they differ, and the forward computes gradients whenever one will be needed
(eager calls with grad enabled, "mean" and "sum" only), once: a second backward through the same graph is refused.
Chunks of about ``2 x N x H / V`` rows keep the peak memory where the vocabulary chunks and their fp32 accumulator
have it.
"""

from typing import Optional

import torch
import torch.nn.functional as F

from fabriclite.kernels import fused_cross_entropy
from fabriclite.kernels._common import as_rows, cast, check_dtypes, library_op
from fabriclite.kernels._linear_cross_entropy_kernels import fold, overwrite_with_gradient
from fabriclite._versions import addmm_out_dtype_supported

_REDUCTIONS = ("mean", "sum", "none")
# Vocabulary columns per chunk; None picks _chunk_cols(). Tests lower it to run many chunks on small shapes.
CHUNK_COLS: Optional[int] = None
# The row-chunk design (see above); benchmarks/kernels.py times it next to the vocabulary chunks. CHUNK_ROWS: rows
# per chunk there, None picks _chunk_rows().
GRADIENT_IN_FORWARD = False
CHUNK_ROWS: Optional[int] = None


def _chunk_cols(n_rows: int, hidden_size: int, vocab_size: int) -> int:
    """Columns whose (N, cols) logits take about as much memory as the (N, H) hidden states, and at least 2**24
    logits, so that a chunk's matmuls are not too small to run at full speed."""
    if CHUNK_COLS is not None:
        return CHUNK_COLS
    cols = max(hidden_size, (1 << 24) // max(n_rows, 1))
    return min(vocab_size, max(256, cols // 256 * 256))


def _chunk_rows(n_rows: int, hidden_size: int, vocab_size: int) -> int:
    """Rows whose (rows, V) logits take about 2 x N x H elements, what the vocabulary design's chunk and fp32
    accumulator of hidden's gradient take together; a multiple of 64 rows, at least 64 (or all of them)."""
    if CHUNK_ROWS is not None:
        return CHUNK_ROWS
    rows = 2 * n_rows * hidden_size // max(vocab_size, 1)
    return max(1, min(n_rows, max(64, rows // 64 * 64)))


def _chunks(n_rows: int, hidden_size: int, vocab_size: int) -> list[tuple[int, int]]:
    cols = _chunk_cols(n_rows, hidden_size, vocab_size)
    return [(start, min(start + cols, vocab_size)) for start in range(0, vocab_size, cols)]


def _chunk_logits(hidden, weight, bias, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the chunk's (N, cols) logits, its weight rows), in hidden's dtype: fp32 master weights (bf16 autocast) are
    cast a chunk at a time, never the whole (V, H) matrix at once."""
    chunk_weight = cast(weight[start:end], hidden.dtype)
    chunk_bias = cast(bias[start:end], hidden.dtype) if bias is not None else None
    return F.linear(hidden, chunk_weight, chunk_bias), chunk_weight


def _forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    ignore_index: int,
    label_smoothing: float,
    reduction: str,
    softcap: Optional[float],
    z_loss: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, state, n_valid): state the per-row fp32 m, d (and the smoothing sums) the backward reads, n_valid the
    rows not ignored for "mean" (empty otherwise)."""
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    if not target.is_contiguous():
        target = target.contiguous()
    state = torch.empty(5 * n_rows, dtype=torch.float32, device=hidden.device)
    row_loss = torch.zeros(n_rows, dtype=torch.float32, device=hidden.device)
    chunks = _chunks(n_rows, hidden_size, vocab_size)
    options = (ignore_index, label_smoothing, softcap, z_loss)
    for index, (start, end) in enumerate(chunks):
        if n_rows == 0:
            break
        logits, _ = _chunk_logits(hidden, weight, bias, start, end)
        fold(logits, target, state, row_loss, start, vocab_size, options, index == 0, index == len(chunks) - 1)
        del logits  # before the next chunk's: one chunk of logits at a time
    n_valid = (target != ignore_index).sum() if reduction == "mean" else row_loss.new_empty(0)
    return fused_cross_entropy.reduce(row_loss, n_valid, reduction, hidden.dtype), state, n_valid


def _add_matmul(accumulator: torch.Tensor, a: torch.Tensor, b: torch.Tensor, fp32_out: bool) -> None:
    """``accumulator += a @ b`` with an fp32 or compute-dtype accumulator and a, b in the compute dtype."""
    if a.dtype == accumulator.dtype:
        accumulator.addmm_(a, b)
    elif fp32_out:  # Ampere and newer: the GEMM accumulates into the fp32 tensor directly
        torch.addmm(accumulator, a, b, out_dtype=torch.float32, out=accumulator)
    else:  # one (N, H) temporary in the compute dtype, rounded once per chunk
        accumulator.add_(a @ b)


def _fp32_out(device: torch.device) -> bool:
    """Whether ``torch.addmm(..., out_dtype=torch.float32)`` adds a bf16/fp16 product into an fp32 tensor directly:
    CUDA-only, Ampere and newer, and newer than our oldest supported torch."""
    return device.type == "cuda" and addmm_out_dtype_supported() and torch.cuda.get_device_capability(device)[0] >= 8


def _forward_and_gradients(
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
) -> tuple[torch.Tensor, tuple[Optional[torch.Tensor], ...]]:
    """The row-chunk design: (loss, (grad_hidden, grad_weight, grad_bias)), the gradients those of a loss whose
    gradient is 1 (None where ``needs_grad`` does not ask). "mean" and "sum" only."""
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    want_hidden, want_weight, want_bias = needs_grad
    want_bias = want_bias and bias is not None
    if not target.is_contiguous():
        target = target.contiguous()
    mean = reduction == "mean"
    row_loss = torch.zeros(n_rows, dtype=torch.float32, device=device)
    n_valid = (target != ignore_index).sum() if mean else row_loss.new_empty(0)
    one = torch.ones((), dtype=torch.float32, device=device)  # the loss's gradient, applied in the backward
    compute_weight = cast(weight, dtype)
    compute_bias = cast(bias, dtype) if bias is not None else None
    grad_hidden = torch.empty((n_rows, hidden_size), dtype=dtype, device=device) if want_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=weight.dtype, device=device) if want_weight else None
    grad_bias = torch.zeros(vocab_size, dtype=torch.float32, device=device) if want_bias else None
    options = (ignore_index, label_smoothing, softcap, z_loss)
    fp32_out = _fp32_out(device)
    step = _chunk_rows(n_rows, hidden_size, vocab_size)
    for start in range(0, n_rows, step):
        end = min(start + step, n_rows)
        rows, chunk_hidden, chunk_target = end - start, hidden[start:end], target[start:end]
        logits = F.linear(chunk_hidden, compute_weight, compute_bias)  # whole rows: one chunk of the vocabulary
        state = torch.empty(5 * rows, dtype=torch.float32, device=device)
        fold(logits, chunk_target, state, row_loss[start:end], 0, vocab_size, options, True, True)
        overwrite_with_gradient(logits, chunk_target, state, one, 0, n_valid, 0, vocab_size, options)
        grad_logits = logits
        if want_hidden:
            torch.mm(grad_logits, compute_weight, out=grad_hidden[start:end])
        if want_weight:  # rounded once per chunk in the weight's dtype
            _add_matmul(grad_weight, grad_logits.t(), chunk_hidden, fp32_out)
        if want_bias:
            grad_bias += grad_logits.sum(dim=0, dtype=torch.float32)
        del logits, grad_logits
    loss = fused_cross_entropy.reduce(row_loss, n_valid, reduction, dtype)
    return loss, (grad_hidden, grad_weight, cast(grad_bias, bias.dtype) if grad_bias is not None else None)


def _backward(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    state: torch.Tensor,
    n_valid: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: Optional[float],
    z_loss: float,
    needs_grad: list[bool],
) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The gradients of hidden, weight and bias (None where ``needs_grad`` does not ask), the chunks' logits
    recomputed and overwritten with their gradient."""
    n_rows, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    want_hidden, want_weight, want_bias = needs_grad
    want_bias = want_bias and bias is not None
    if not target.is_contiguous():
        target = target.contiguous()
    # (N,) for "none", () otherwise; an expanded (N,) gradient keeps its stride 0.
    grad_output = as_rows(grad_loss, 1) if grad_loss.dim() else grad_loss
    grad_output_stride = grad_output.stride(0) if grad_output.dim() else 0
    grad_hidden = torch.zeros((n_rows, hidden_size), dtype=torch.float32, device=device) if want_hidden else None
    grad_weight = torch.empty(weight.shape, dtype=weight.dtype, device=device) if want_weight else None
    grad_bias = torch.empty(vocab_size, dtype=bias.dtype, device=device) if want_bias else None
    fp32_out = _fp32_out(device)
    options = (ignore_index, label_smoothing, softcap, z_loss)
    for start, end in _chunks(n_rows, hidden_size, vocab_size) if (n_rows and any(needs_grad)) else ():
        logits, chunk_weight = _chunk_logits(hidden, weight, bias, start, end)
        overwrite_with_gradient(
            logits, target, state, grad_output, grad_output_stride, n_valid, start, vocab_size, options
        )
        grad_logits = logits
        if want_weight:  # all N tokens summed inside one matmul: rounded once, in the weight's dtype
            if grad_weight.dtype == dtype:
                torch.mm(grad_logits.t(), hidden, out=grad_weight[start:end])
            else:
                grad_weight[start:end] = grad_logits.t() @ hidden
        if want_bias:
            grad_bias[start:end] = grad_logits.sum(dim=0, dtype=torch.float32)
        if want_hidden:
            _add_matmul(grad_hidden, grad_logits, chunk_weight, fp32_out)
        del logits, grad_logits
    if grad_hidden is not None:
        grad_hidden = cast(grad_hidden, dtype)
    if n_rows == 0:  # no chunk ran: nothing to sum
        grad_weight = grad_weight.zero_() if grad_weight is not None else None
        grad_bias = grad_bias.zero_() if grad_bias is not None else None
    return grad_hidden, grad_weight, grad_bias


# ---------------------------------------------------------------------- eager: an autograd Function
class _LinearCrossEntropyFunction(torch.autograd.Function):
    """Eager calls: the chunks run directly, without the custom op's dispatch."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, z_loss, grads):
        arguments = (hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, z_loss)
        ctx.gradients, ctx.row_chunks = None, grads
        if grads:  # the row-chunk design: the gradients now, scaled in the backward
            needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]]
            loss, ctx.gradients = _forward_and_gradients(*arguments, needs)
            return loss
        loss, state, n_valid = _forward(*arguments)
        ctx.save_for_backward(hidden, weight, target, bias, state, n_valid)
        ctx.config = (ignore_index, label_smoothing, softcap, z_loss)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss):
        if ctx.row_chunks:
            if ctx.gradients is None:
                raise RuntimeError(
                    "linear_cross_entropy with fused_linear_cross_entropy.GRADIENT_IN_FORWARD makes its gradients "
                    "once, in the forward, and hands them to the first backward; a second backward through the same "
                    "graph (retain_graph=True) needs GRADIENT_IN_FORWARD = False."
                )
            gradients, ctx.gradients = ctx.gradients, None  # scaled in place and handed over: no second copy
            grad_hidden, grad_weight, grad_bias = (g.mul_(grad_loss) if g is not None else None for g in gradients)
            return grad_hidden, grad_weight, None, grad_bias, None, None, None, None, None, None
        hidden, weight, target, bias, state, n_valid = ctx.saved_tensors
        needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3]]
        grad_hidden, grad_weight, grad_bias = _backward(
            grad_loss, hidden, weight, target, bias, state, n_valid, *ctx.config, needs
        )
        return grad_hidden, grad_weight, None, grad_bias, None, None, None, None, None, None


# ---------------------------------------------------------------------- traced: torch.library registration
def _linear_cross_entropy_op_fake(
    hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, z_loss
):
    n_rows = hidden.shape[0]
    loss = hidden.new_empty((n_rows,) if reduction == "none" else ())
    state = hidden.new_empty(5 * n_rows, dtype=torch.float32)
    n_valid = target.new_empty(()) if reduction == "mean" else hidden.new_empty(0, dtype=torch.float32)
    return loss, state, n_valid


@library_op("fabriclite::linear_cross_entropy", fake=_linear_cross_entropy_op_fake)
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (loss, state, n_valid): what the backward op needs besides the inputs."""
    return _forward(hidden, weight, target, bias, ignore_index, label_smoothing, reduction, softcap, z_loss)


def _linear_cross_entropy_backward_op_fake(
    grad_loss, hidden, weight, target, bias, state, n_valid, ignore_index, label_smoothing, softcap, z_loss, needs
):
    want_hidden, want_weight, want_bias = needs
    return (
        hidden.new_empty(hidden.shape) if want_hidden else hidden.new_empty(0),
        weight.new_empty(weight.shape) if want_weight else hidden.new_empty(0),
        bias.new_empty(bias.shape) if want_bias and bias is not None else hidden.new_empty(0),
    )


@library_op("fabriclite::linear_cross_entropy_backward", fake=_linear_cross_entropy_backward_op_fake)
def _linear_cross_entropy_backward_op(
    grad_loss: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    bias: Optional[torch.Tensor],
    state: torch.Tensor,
    n_valid: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    softcap: Optional[float],
    z_loss: float,
    needs_grad: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of hidden, weight and bias (empty tensors where ``needs_grad`` does not ask)."""
    grads = _backward(
        grad_loss, hidden, weight, target, bias, state, n_valid, ignore_index, label_smoothing, softcap, z_loss,
        needs_grad,
    )  # fmt: skip
    return tuple(grad if grad is not None else hidden.new_empty(0) for grad in grads)


def _setup_context(ctx, inputs, output) -> None:
    hidden, weight, target, bias, ignore_index, label_smoothing, _, softcap, z_loss = inputs
    _, state, n_valid = output
    ctx.save_for_backward(hidden, weight, target, bias, state, n_valid)
    ctx.config = (ignore_index, label_smoothing, softcap, z_loss)
    ctx.mark_non_differentiable(state, n_valid)


def _backward_formula(ctx, grad_loss, _grad_state, _grad_n_valid):
    hidden, weight, target, bias, state, n_valid = ctx.saved_tensors
    needs = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[3] and bias is not None]
    grads = torch.ops.fabriclite.linear_cross_entropy_backward(
        grad_loss, hidden, weight, target, bias, state, n_valid, *ctx.config, needs
    )
    grad_hidden, grad_weight, grad_bias = (grad if need else None for grad, need in zip(grads, needs))
    return grad_hidden, grad_weight, None, grad_bias, None, None, None, None, None


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
    (N,) class indices, without ever holding the (N, V) logits: computed in chunks of the vocabulary, gradients included.

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
    arguments = (
        hidden,
        weight,
        target,
        bias,
        ignore_index,
        float(label_smoothing),
        reduction,
        float(softcap) if softcap is not None else None,
        float(z_loss),
    )
    if torch.compiler.is_compiling():
        return torch.ops.fabriclite.linear_cross_entropy(*arguments)[0]
    grads = (
        GRADIENT_IN_FORWARD
        and reduction != "none"
        and torch.is_grad_enabled()
        and (hidden.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad))
    )
    return _LinearCrossEntropyFunction.apply(*arguments, grads)


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
