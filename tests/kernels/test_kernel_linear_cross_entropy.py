"""linear_cross_entropy against plain torch, ``F.cross_entropy(F.linear(hidden, weight, bias), target)``: the loss
and the gradients of hidden, weight and bias over several chunks of the vocabulary, and proof that no (N, V) tensor
is made.

fp32 results must match a float64 reference to 1e-5 (``assert_matches``). bf16 results must be as close to the
float64 reference (computed from the same bf16-rounded inputs) as torch's own bf16 computation is: its error,
measured norm-wise, at most ``BF16_FACTOR`` times torch's. Triton's interpreter rounds fp32 to bf16 by truncating
(one ulp where the GPU's round-to-nearest loses half, and always towards zero, so a sum of such values does not
average the errors out): the gradient of the logits, stored in bf16, carries twice torch's rounding there and more
once summed (the bias's gradient, a sum over the tokens, came to 2.2 times torch's error).
"""

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, INTERPRET, assert_matches, launched, leaf_pair
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fabriclite.kernels import LinearCrossEntropyLoss, _common, fused_linear_cross_entropy, linear_cross_entropy

KERNEL = "_linear_cross_entropy_forward_kernel"
BACKWARD = "_linear_cross_entropy_backward_kernel"
N, H, V = 37, 24, 101
CHUNK = 48  # the tests' chunks: 48, 48 and 5 columns of the vocabulary (first, middle, last)
IGNORED = (3, 10, 36)
BF16_FACTOR = 2.5 if INTERPRET else 2.0


@pytest.fixture(autouse=True)
def _several_chunks(monkeypatch):
    monkeypatch.setattr(fused_linear_cross_entropy, "CHUNK_COLS", CHUNK)


def _inputs(dtype: torch.dtype, seed: int = 0, bias: bool = True, ignore_index: int = -100):
    """(hidden, weight, bias) leaves in ``dtype`` and their float64 twins, and targets with ignored rows."""
    torch.manual_seed(seed)
    hidden = leaf_pair(torch.randn(N, H), dtype)
    weight = leaf_pair(torch.randn(V, H) / H**0.5 * 3, dtype)  # logits of std 3
    bias_pair = leaf_pair(torch.randn(V), dtype) if bias else (None, None)
    target = torch.randint(0, V, (N,))
    target[list(IGNORED)] = ignore_index
    return hidden, weight, bias_pair, target.to(DEVICE)


def _upstream(reduction: str, dtype: torch.dtype) -> torch.Tensor:
    """A gradient for the loss that is not 1: a scalar for "mean" and "sum", one per row for "none"."""
    return (torch.randn(N) if reduction == "none" else torch.tensor(0.7)).to(DEVICE, dtype)


def _reference(
    hidden,
    weight,
    target,
    bias=None,
    ignore_index=-100,
    label_smoothing=0.0,
    reduction="mean",
    softcap=None,
    z_loss=0.0,
):
    """The plain torch formula: Gemma 2's softcap on the logits, PaLM's z-loss on their logsumexp."""
    logits = F.linear(hidden, weight, bias)
    if softcap is None and not z_loss:
        return F.cross_entropy(
            logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction
        )
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    valid = target != ignore_index
    loss = F.cross_entropy(logits, target, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="none")
    loss = loss + z_loss * torch.where(valid, torch.logsumexp(logits, dim=-1).square(), 0.0)
    if reduction == "none":
        return loss
    return loss.sum() / valid.sum() if reduction == "mean" else loss.sum()


def _run(fn, leaves, target, upstream, **kwargs):
    """fn's loss and the gradients of its leaves (None where a leaf is absent)."""
    loss = fn(*leaves[:2], target, leaves[2], **kwargs)
    loss.backward(upstream)
    return [loss.detach()] + [leaf.grad if leaf is not None else None for leaf in leaves]


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected).norm() / expected.norm()).item()


def _assert_close_to_reference(dtype, ours, reference, torch_own, names=("loss", "hidden", "weight", "bias")):
    """fp32: within 1e-5 of the float64 reference. bf16: no farther from it than torch's own bf16 result, within
    BF16_FACTOR."""
    for name, actual, expected, theirs in zip(names, ours, reference, torch_own):
        if expected is None:
            assert actual is None, f"{name} got a gradient it should not have"
            continue
        if dtype == torch.float32:
            assert_matches(actual, expected, dtype)
            continue
        assert actual.dtype == dtype and torch.isfinite(actual).all()
        ours_error, torch_error = _relative_error(actual, expected), _relative_error(theirs, expected)
        assert ours_error <= BF16_FACTOR * torch_error + 1e-6, (
            f"{name}: relative error {ours_error:.2e}, torch's own bf16 {torch_error:.2e}"
        )


def _compare(dtype, bias=True, ignore_index=-100, seed=0, **kwargs):
    hidden, weight, bias_pair, target = _inputs(dtype, seed, bias, ignore_index)
    reduction = kwargs.get("reduction", "mean")
    upstream = _upstream(reduction, dtype)
    leaves, reference_leaves = zip(hidden, weight, bias_pair)  # (ours), (float64 twins)
    torch_leaves = [leaf.detach().clone().requires_grad_() if leaf is not None else None for leaf in leaves]

    with launched(KERNEL, BACKWARD):
        ours = _run(linear_cross_entropy, list(leaves), target, upstream, ignore_index=ignore_index, **kwargs)
    reference = _run(_reference, list(reference_leaves), target, upstream.double(), ignore_index=ignore_index, **kwargs)
    torch_own = _run(_reference, torch_leaves, target, upstream, ignore_index=ignore_index, **kwargs)
    _assert_close_to_reference(dtype, ours, reference, torch_own)
    return ours


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_and_gradients_match_torch_over_several_chunks_with_ignored_rows(reduction, bias, dtype):
    loss, grad_hidden, *_ = _compare(dtype, bias=bias, reduction=reduction)
    assert torch.all(grad_hidden[list(IGNORED)] == 0), "ignored rows must get a zero gradient"
    if reduction == "none":
        assert torch.all(loss[list(IGNORED)] == 0), "ignored rows must add 0 to the loss"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_label_smoothing_and_another_ignore_index_match_torch(reduction, dtype):
    _compare(dtype, ignore_index=7, seed=1, reduction=reduction, label_smoothing=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize(
    ("softcap", "z_loss"), [(4.0, 0.0), (None, 1e-2), (4.0, 1e-2)], ids=["softcap", "z_loss", "softcap+z_loss"]
)
def test_softcap_and_z_loss_match_the_plain_torch_formula(softcap, z_loss, reduction, dtype):
    # softcap 4 on logits of std 3: tanh well into its curve, so a missing 1 - tanh**2 would show.
    _compare(dtype, seed=2, reduction=reduction, label_smoothing=0.1, softcap=softcap, z_loss=z_loss)


@pytest.mark.parametrize("chunk_cols", [13, 50, V, 128])
def test_any_chunk_size_gives_the_same_result(monkeypatch, chunk_cols):
    monkeypatch.setattr(fused_linear_cross_entropy, "CHUNK_COLS", chunk_cols)
    before = _common.LAUNCHES[KERNEL], _common.LAUNCHES[BACKWARD]
    _compare(torch.float32, seed=3, label_smoothing=0.1, z_loss=1e-3)
    chunks = -(-V // chunk_cols)
    assert (_common.LAUNCHES[KERNEL] - before[0], _common.LAUNCHES[BACKWARD] - before[1]) == (chunks, chunks)


def test_chunks_hold_about_as_many_logits_as_there_are_hidden_values(monkeypatch):
    monkeypatch.setattr(fused_linear_cross_entropy, "CHUNK_COLS", None)
    chunk_cols = fused_linear_cross_entropy._chunk_cols
    assert chunk_cols(8192, 4096, 128256) == 4096  # Llama-3-8B: 8192 x 4096 logits a chunk, as many as hidden
    assert chunk_cols(1024, 4096, 128256) == 16384  # fewer tokens: wider chunks, at least 2**24 logits
    assert chunk_cols(N, H, V) == V  # a small vocabulary: one chunk


# The row-chunk design (GRADIENT_IN_FORWARD): the tests' chunks are 16, 16 and 5 rows.
CHUNK_ROWS = 16


@pytest.fixture
def row_chunks(monkeypatch):
    monkeypatch.setattr(fused_linear_cross_entropy, "GRADIENT_IN_FORWARD", True)
    monkeypatch.setattr(fused_linear_cross_entropy, "CHUNK_ROWS", CHUNK_ROWS)


def _launches() -> tuple[int, int]:
    return _common.LAUNCHES[KERNEL], _common.LAUNCHES[BACKWARD]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_row_chunks_make_the_gradients_in_the_forward_and_match_torch(row_chunks, reduction, bias, dtype):
    (hidden, _), (weight, _), (bias_leaf, _), target = _inputs(dtype, bias=bias)
    before = _launches()
    loss = linear_cross_entropy(hidden, weight, target, bias_leaf, reduction=reduction)
    chunks = -(-N // CHUNK_ROWS)
    assert tuple(a - b for a, b in zip(_launches(), before)) == (chunks, chunks), "both kernels, once a chunk"
    loss.backward(_upstream(reduction, dtype))
    assert tuple(a - b for a, b in zip(_launches(), before)) == (chunks, chunks), "the backward launches nothing"

    _, grad_hidden, *_ = _compare(dtype, bias=bias, reduction=reduction)
    assert torch.all(grad_hidden[list(IGNORED)] == 0), "ignored rows must get a zero gradient"


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize(("softcap", "z_loss"), [(None, 0.0), (4.0, 1e-2)], ids=["smoothing", "all options"])
def test_row_chunks_with_label_smoothing_softcap_and_z_loss_match_the_plain_torch_formula(
    row_chunks, softcap, z_loss, reduction
):
    _compare(torch.float32, ignore_index=7, seed=2, reduction=reduction, label_smoothing=0.1, softcap=softcap,
             z_loss=z_loss)  # fmt: skip


def test_row_chunks_leave_reduction_none_and_calls_without_grad_to_the_vocabulary_chunks(row_chunks):
    (hidden, _), (weight, _), (bias, _), target = _inputs(torch.float32)
    before = _launches()
    with torch.no_grad():
        linear_cross_entropy(hidden, weight, target, bias)
    vocabulary_chunks = -(-V // CHUNK)
    assert tuple(a - b for a, b in zip(_launches(), before)) == (vocabulary_chunks, 0), "no gradient without grad"
    loss, grad_hidden, *_ = _compare(torch.float32, reduction="none")  # a per-row gradient: the vocabulary chunks
    assert torch.all(loss[list(IGNORED)] == 0) and torch.all(grad_hidden[list(IGNORED)] == 0)


def test_row_chunks_refuse_a_second_backward_through_the_same_graph_saying_what_works(row_chunks):
    (hidden, _), (weight, _), _, target = _inputs(torch.float32, bias=False)
    loss = linear_cross_entropy(hidden, weight, target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="GRADIENT_IN_FORWARD = False"):
        loss.backward()


def test_row_chunks_keep_fp32_gradients_for_fp32_master_weights(row_chunks):
    test_fp32_master_weights_with_bf16_hidden_states_compute_in_bf16_and_keep_fp32_gradients("mean")


def test_row_chunks_hold_about_twice_as_many_logits_as_there_are_hidden_values(monkeypatch):
    monkeypatch.setattr(fused_linear_cross_entropy, "CHUNK_ROWS", None)
    chunk_rows = fused_linear_cross_entropy._chunk_rows
    assert chunk_rows(8192, 4096, 128256) == 512  # Llama-3-8B: 512 x 128256 logits, about 2 x 8192 x 4096
    assert chunk_rows(8192, 768, 50257) == 192
    assert chunk_rows(100, 4096, 128256) == 64  # never fewer than 64 rows, never more than there are
    assert chunk_rows(N, H, V) == N


class _LargestTensor(TorchDispatchMode):
    """Records the most bytes any tensor made by a torch op inside it holds (bytes, not elements: Triton's
    interpreter copies a kernel's arguments to and from byte tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() * t.element_size() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def test_no_tensor_as_large_as_the_logits_is_ever_made():
    # Forward and backward with every option that could add a buffer, watched op by op.
    (hidden, _), (weight, _), (bias, _), target = _inputs(torch.float32)
    arguments = (-100, 0.1, 4.0, 1e-3)
    with torch.no_grad(), _LargestTensor() as mode:
        loss, state, n_valid = fused_linear_cross_entropy._forward(
            hidden, weight, target, bias, -100, 0.1, "none", 4.0, 1e-3
        )
        grads = fused_linear_cross_entropy._backward(
            torch.randn(N, device=DEVICE), hidden, weight, target, bias, state, n_valid, *arguments, [True] * 3
        )
    assert all(grad is not None for grad in grads)
    # The largest tensors are the gradients themselves (V x H, N x H) and one chunk's logits (N x 48), all fp32.
    assert mode.largest == 4 * max(V * H, N * H, N * CHUNK) < 4 * N * V, mode.largest


def test_a_frozen_weight_gets_no_gradient_and_hidden_still_does():
    hidden, (weight, weight_reference), _, target = _inputs(torch.float32, bias=False)
    weight.requires_grad_(False)
    weight_reference.requires_grad_(False)
    loss = linear_cross_entropy(hidden[0], weight, target)
    loss.backward()
    expected = F.cross_entropy(F.linear(hidden[1], weight_reference), target)
    expected.backward()

    assert weight.grad is None
    assert_matches(loss.detach(), expected.detach(), torch.float32)
    assert_matches(hidden[0].grad, hidden[1].grad, torch.float32)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_fp32_master_weights_with_bf16_hidden_states_compute_in_bf16_and_keep_fp32_gradients(reduction):
    # As under bf16 autocast: the matmuls run in bf16 on the weight cast once; its gradient comes back in fp32.
    torch.manual_seed(4)
    hidden, hidden_reference = leaf_pair(torch.randn(N, H), torch.bfloat16)
    weight = (torch.randn(V, H, device=DEVICE) / H**0.5 * 3).requires_grad_()
    bias = torch.randn(V, device=DEVICE, requires_grad=True)
    target = _inputs(torch.float32)[3]
    upstream = _upstream(reduction, torch.bfloat16)

    loss = linear_cross_entropy(hidden, weight, target, bias, reduction=reduction)
    loss.backward(upstream)
    # References: the same rounding of the parameters to bf16, then float64 (and torch's own bf16) from there.
    weight_reference, bias_reference = (p.detach().bfloat16().double().requires_grad_() for p in (weight, bias))
    expected = F.cross_entropy(
        F.linear(hidden_reference, weight_reference, bias_reference), target, reduction=reduction
    )
    expected.backward(upstream.double())
    torch_leaves = [leaf.detach().clone().requires_grad_() for leaf in (hidden, weight, bias)]
    torch_loss = F.cross_entropy(
        F.linear(torch_leaves[0], torch_leaves[1].bfloat16(), torch_leaves[2].bfloat16()), target, reduction=reduction
    )
    torch_loss.backward(upstream)

    assert weight.grad.dtype == torch.float32 and bias.grad.dtype == torch.float32
    ours = [loss.detach(), hidden.grad, weight.grad.bfloat16(), bias.grad.bfloat16()]
    reference = [expected.detach(), hidden_reference.grad, weight_reference.grad, bias_reference.grad]
    torch_own = [torch_loss.detach(), *(leaf.grad.bfloat16() for leaf in torch_leaves)]
    _assert_close_to_reference(torch.bfloat16, ours, reference, torch_own)


def test_the_module_computes_the_function():
    hidden, weight, bias, target = _inputs(torch.float32)
    module = LinearCrossEntropyLoss(ignore_index=-100, reduction="sum", label_smoothing=0.1, softcap=4.0, z_loss=1e-3)
    expected = linear_cross_entropy(hidden[0], weight[0], target, bias[0], -100, 0.1, "sum", 4.0, 1e-3)

    torch.testing.assert_close(module(hidden[0], weight[0], target, bias[0]), expected)
    assert "softcap=4.0" in repr(module) and "z_loss=0.001" in repr(module)


def test_without_grad_no_gradient_is_computed_and_the_loss_is_the_same():
    hidden, weight, bias, target = _inputs(torch.float32)
    with torch.no_grad():
        loss = linear_cross_entropy(hidden[0], weight[0], target, bias[0], z_loss=1e-3)
    expected = _reference(hidden[1], weight[1], target, bias[1], z_loss=1e-3)
    assert not loss.requires_grad
    assert_matches(loss, expected.detach(), torch.float32)


BAD_CALLS = {
    "float64": (
        lambda: linear_cross_entropy(torch.randn(3, 4, dtype=torch.float64), torch.randn(5, 4), torch.zeros(3).long()),
        TypeError,
        r"got a torch\.float64 tensor.*float32, bfloat16 and float16",
    ),
    "3-D hidden": (
        lambda: linear_cross_entropy(torch.randn(2, 3, 4), torch.randn(5, 4), torch.zeros(2, 3).long()),
        ValueError,
        r"\(N, H\) hidden states.*view\(-1, H\)",
    ),
    "widths differ": (
        lambda: linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 6), torch.zeros(3).long()),
        ValueError,
        r"\(V, H\) weight",
    ),
    "bias": (
        lambda: linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3).long(), torch.randn(4)),
        ValueError,
        r"\(5,\) bias",
    ),
    "reduction": (
        lambda: linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3).long(), reduction="avg"),
        ValueError,
        r"reduction='avg'.*\('mean', 'sum', 'none'\)",
    ),
    "softcap": (
        lambda: linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3).long(), softcap=0.0),
        ValueError,
        r"softcap=0.0 must be positive",
    ),
    "z_loss": (
        lambda: linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4), torch.zeros(3).long(), z_loss=-1.0),
        ValueError,
        r"z_loss=-1.0 must be 0",
    ),
}


@pytest.mark.parametrize("call", BAD_CALLS.values(), ids=BAD_CALLS.keys())
def test_a_bad_argument_is_refused_saying_what_works(call):
    fn, error, message = call
    with pytest.raises(error, match=message):
        fn()


# ---------------------------------------------------------------------- torch.library and torch.compile
def _opcheck_cases() -> list:
    torch.manual_seed(5)

    def leaf(*shape):
        return torch.randn(*shape, device=DEVICE, requires_grad=True)

    def plain(*shape):
        return torch.randn(*shape, device=DEVICE)

    target = torch.tensor([0, 8, -100, 3, 5], device=DEVICE)
    everything = [True, True, True]
    # state: per row m, d, the smoothing sum, its reference, the target's logit; n_valid for "mean", else empty
    state = torch.cat([torch.randn(5, device=DEVICE), torch.rand(5, device=DEVICE) + 1, torch.randn(15, device=DEVICE)])
    n_valid, empty = target.new_tensor(4), torch.empty(0, device=DEVICE)
    return [
        ("linear_cross_entropy", (leaf(5, 6), leaf(9, 6), target, leaf(9), -100, 0.1, "mean", None, 0.0)),
        ("linear_cross_entropy", (leaf(5, 6), plain(9, 6), target, None, -100, 0.0, "sum", 3.0, 1e-3)),
        ("linear_cross_entropy", (leaf(5, 6), leaf(9, 6), target, leaf(9), -100, 0.1, "none", 3.0, 1e-3)),
        ("linear_cross_entropy", (plain(5, 6), plain(9, 6), target, None, -100, 0.0, "mean", None, 0.0)),
        (
            "linear_cross_entropy_backward",
            (plain(5), plain(5, 6), plain(9, 6), target, plain(9), state, empty, -100, 0.1, 3.0, 1e-3, everything),
        ),
        (
            "linear_cross_entropy_backward",
            (
                plain(5)[0],
                plain(5, 6),
                plain(9, 6),
                target,
                None,
                state,
                n_valid,
                -100,
                0.0,
                None,
                0.0,
                [False, True, False],
            ),
        ),  # fmt: skip
    ]


@pytest.mark.parametrize("case", _opcheck_cases(), ids=lambda case: case[0])
def test_opcheck_passes_for_both_ops(case):
    name, args = case
    with launched(KERNEL if name == "linear_cross_entropy" else BACKWARD):
        results = torch.library.opcheck(getattr(torch.ops.fabriclite, name), args, raise_exception=False)
    assert results == dict.fromkeys(results, "SUCCESS"), results


def _step(hidden, weight, bias, target, row_weights):
    mean = linear_cross_entropy(hidden, weight, target, bias, label_smoothing=0.1, softcap=4.0, z_loss=1e-3)
    per_row = linear_cross_entropy(hidden, weight, target, reduction="none")
    return mean + (per_row * row_weights).sum()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_traces_it_into_one_graph_with_its_backward(backend):
    hidden, weight, bias, target = _inputs(torch.float32)
    leaves = [hidden[0], weight[0], bias[0]]
    row_weights = torch.rand(N, device=DEVICE)
    expected = _step(*leaves, target, row_weights)
    expected.backward()
    expected_grads = [leaf.grad for leaf in leaves]
    for leaf in leaves:
        leaf.grad = None

    torch._dynamo.reset()
    compiled = torch.compile(_step, backend=backend, fullgraph=True)  # a graph break raises here
    with launched(KERNEL, BACKWARD):
        loss = compiled(*leaves, target, row_weights)
        loss.backward()

    torch.testing.assert_close(loss, expected)
    for leaf, grad in zip(leaves, expected_grads):
        torch.testing.assert_close(leaf.grad, grad)
