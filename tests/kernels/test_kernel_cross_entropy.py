import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, assert_matches, launched, leaf_pair

from fabriclite.kernels import CrossEntropyLoss, cross_entropy, fused_cross_entropy

FORWARD = "_cross_entropy_forward_kernel"
BACKWARD = "_cross_entropy_backward_kernel"


def _targets(n_rows: int, n_classes: int, ignored: tuple[int, ...] = (), ignore_index: int = -100) -> torch.Tensor:
    target = torch.randint(0, n_classes, (n_rows,))
    target[list(ignored)] = ignore_index
    return target.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_loss_and_gradient_match_torch_with_ignored_rows(reduction, label_smoothing, dtype):
    torch.manual_seed(0)
    logits, reference = leaf_pair(3 * torch.randn(6, 37), dtype)
    target = _targets(6, 37, ignored=(1, 4))
    # "none" gets a strided (non-contiguous) upstream gradient, the others a scalar one that is not 1.
    upstream = (
        torch.randn(12, dtype=dtype, device=DEVICE)[::2] if reduction == "none" else torch.tensor(0.7, dtype=dtype)
    )

    with launched(FORWARD, BACKWARD):
        loss = cross_entropy(logits, target, label_smoothing=label_smoothing, reduction=reduction)
        loss.backward(upstream.to(DEVICE))
    expected = F.cross_entropy(reference, target, label_smoothing=label_smoothing, reduction=reduction)
    expected.backward(upstream.double().to(DEVICE))

    assert_matches(loss, expected, dtype)
    assert_matches(logits.grad, reference.grad, dtype)
    assert torch.all(logits.grad[[1, 4]] == 0), "ignored rows must get a zero gradient"


@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_rows_wider_than_one_block_are_swept_block_by_block(monkeypatch, label_smoothing):
    monkeypatch.setattr(fused_cross_entropy, "MAX_BLOCK", 16)  # 53 classes: three full blocks and a partial one
    torch.manual_seed(1)
    logits, reference = leaf_pair(4 * torch.randn(3, 53), torch.float32)
    target = _targets(3, 53, ignored=(2,), ignore_index=7)

    with launched(FORWARD, BACKWARD):
        loss = cross_entropy(logits, target, ignore_index=7, label_smoothing=label_smoothing)
        loss.backward()
    expected = F.cross_entropy(reference, target, ignore_index=7, label_smoothing=label_smoothing)
    expected.backward()

    assert_matches(loss, expected, torch.float32)
    assert_matches(logits.grad, reference.grad, torch.float32)


def test_a_block_of_minus_infinity_logits_stays_finite(monkeypatch):
    # A masked vocabulary: the whole first block is -inf, which must not turn the running max into NaN.
    monkeypatch.setattr(fused_cross_entropy, "MAX_BLOCK", 16)
    torch.manual_seed(2)
    values = torch.randn(2, 40)
    values[:, :20] = float("-inf")
    logits, reference = leaf_pair(values, torch.float32)
    target = torch.tensor([25, 39], device=DEVICE)

    with launched(FORWARD):
        loss = cross_entropy(logits, target)
        loss.backward()
    expected = F.cross_entropy(reference, target)
    expected.backward()

    assert_matches(loss, expected, torch.float32)
    assert_matches(logits.grad, reference.grad, torch.float32)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_logits_with_a_large_common_offset_keep_fp32_accuracy(reduction, label_smoothing):
    # Softmax ignores a common offset; a kernel that forms lse = m + log(d) near 1e4 and subtracts it late keeps
    # only fp32's 1e-3 absolute resolution there, far off the float64 loss and gradient.
    torch.manual_seed(6)
    logits, reference = leaf_pair(3 * torch.randn(64, 1000) + 1e4, torch.float32)
    target = _targets(64, 1000, ignored=(5,))

    with launched(FORWARD, BACKWARD):
        loss = cross_entropy(logits, target, label_smoothing=label_smoothing, reduction=reduction)
        loss.sum().backward()
    expected = F.cross_entropy(reference, target, label_smoothing=label_smoothing, reduction=reduction)
    expected.sum().backward()

    torch.testing.assert_close(loss.double(), expected, rtol=1e-6, atol=0.0)
    assert_matches(logits.grad, reference.grad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_single_row_with_an_expanded_upstream_gradient(dtype):
    torch.manual_seed(3)
    logits, reference = leaf_pair(torch.randn(1, 37), dtype)
    target = _targets(1, 37)

    with launched(FORWARD, BACKWARD):
        loss = cross_entropy(logits, target, reduction="none", label_smoothing=0.05)
        loss.sum().backward()  # the gradient reaching the op is a stride-0 expand of one value
    expected = F.cross_entropy(reference, target, reduction="none", label_smoothing=0.05)
    expected.sum().backward()

    assert_matches(loss, expected, dtype)
    assert_matches(logits.grad, reference.grad, dtype)


def test_all_rows_ignored_gives_a_nan_mean_and_a_zero_gradient_as_torch_does():
    logits = torch.randn(3, 11, device=DEVICE, requires_grad=True)
    target = torch.full((3,), -100, device=DEVICE)
    with launched(FORWARD):
        loss = cross_entropy(logits, target)
        loss.backward()
    assert torch.isnan(loss) and torch.isnan(F.cross_entropy(logits.detach(), target))
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_without_grad_the_loss_is_computed_and_no_gradient_is_kept():
    torch.manual_seed(4)
    logits = torch.randn(4, 19, device=DEVICE, requires_grad=True)
    target = _targets(4, 19)
    with torch.no_grad(), launched(FORWARD):
        loss = cross_entropy(logits, target, label_smoothing=0.1)
    assert loss.grad_fn is None
    assert_matches(loss, F.cross_entropy(logits.detach().double(), target, label_smoothing=0.1), torch.float32)


def test_the_module_matches_nn_cross_entropy_loss():
    torch.manual_seed(5)
    logits = torch.randn(5, 23, device=DEVICE)
    target = _targets(5, 23, ignored=(0,), ignore_index=3)
    module = CrossEntropyLoss(ignore_index=3, reduction="sum", label_smoothing=0.1)
    expected = torch.nn.CrossEntropyLoss(ignore_index=3, reduction="sum", label_smoothing=0.1)(logits.double(), target)
    with launched(FORWARD):
        assert_matches(module(logits, target), expected, torch.float32)


@pytest.mark.parametrize(
    ("logits_shape", "target_shape", "kwargs", "message"),
    [
        ((2, 3, 5), (2, 3), {}, "flatten"),
        ((4, 5), (4,), {"reduction": "max"}, "reduction="),
        ((4, 5), (4,), {"label_smoothing": 1.5}, "label_smoothing="),
    ],
)
def test_bad_arguments_are_refused_with_the_valid_choices(logits_shape, target_shape, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cross_entropy(torch.randn(logits_shape), torch.zeros(target_shape, dtype=torch.long), **kwargs)


class _LogitSizedAllocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every op output with ``numel`` elements: an (N, C) buffer made while the mode is on."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.numel, self.made = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else [out]:
            if (
                isinstance(tensor, torch.Tensor)
                and tensor.numel() == self.numel
                and not func._schema.is_mutable
                and not func.is_view
            ):
                self.made.append(str(func))
        return out


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_the_forward_makes_no_logits_sized_buffer_and_the_backward_only_the_gradient(reduction):
    torch.manual_seed(0)
    logits, reference = leaf_pair(torch.randn(5, 33), torch.float32)
    target = _targets(5, 33)
    with _LogitSizedAllocations(5 * 33) as forward_allocations:
        loss = cross_entropy(logits, target, reduction=reduction)
    upstream = torch.full_like(loss, 0.5)
    with _LogitSizedAllocations(5 * 33) as backward_allocations:
        loss.backward(upstream)
    assert forward_allocations.made == [], forward_allocations.made
    assert len(backward_allocations.made) == 1, backward_allocations.made  # the gradient itself
    F.cross_entropy(reference, target, reduction=reduction).backward(upstream.double())
    assert_matches(logits.grad, reference.grad, torch.float32)


def test_a_retained_graph_runs_backward_twice_when_the_logits_are_kept():
    torch.manual_seed(3)
    logits, reference = leaf_pair(torch.randn(4, 9), torch.float32)
    target = _targets(4, 9)
    loss = cross_entropy(logits, target)
    loss.backward(retain_graph=True)
    loss.backward()
    F.cross_entropy(reference, target).backward()
    assert_matches(logits.grad, 2 * reference.grad, torch.float32)


def test_a_retained_graph_with_overwritten_logits_cannot_be_run_backward_twice():
    logits = torch.randn(4, 9, device=DEVICE, requires_grad=True) * 1.0  # not a leaf, as a model's logits
    loss = cross_entropy(logits, _targets(4, 9), overwrite_logits=True)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_overwrite_logits_writes_their_gradient_over_a_linear_layers_output(reduction, dtype):
    torch.manual_seed(7)
    hidden, hidden_reference = leaf_pair(torch.randn(6, 8), dtype)
    weight, weight_reference = leaf_pair(torch.randn(41, 8) / 8**0.5, dtype)
    target = _targets(6, 41, ignored=(2,))
    logits = hidden @ weight.T
    # The reference starts from our logits' values (rounded to dtype), so only the cross-entropy is compared.
    reference = logits.detach().double().requires_grad_()
    gradients_seen = []
    logits.register_hook(lambda grad: gradients_seen.append(grad.data_ptr()))
    logits_memory = logits.data_ptr()

    with launched(FORWARD, BACKWARD), _LogitSizedAllocations(6 * 41) as allocations:
        loss = cross_entropy(logits, target, reduction=reduction, label_smoothing=0.1, overwrite_logits=True)
        loss.sum().backward()
    expected = F.cross_entropy(reference, target, reduction=reduction, label_smoothing=0.1)
    expected.sum().backward()

    assert allocations.made == [], f"an (N, C) buffer was made: {allocations.made}"
    assert gradients_seen == [logits_memory], "the logits' gradient must live in the logits' own memory"
    gradient = logits.detach()  # what the logits hold now
    assert_matches(loss, expected, dtype)
    assert_matches(gradient, reference.grad, dtype)
    # It then flows on through the matmul as any gradient would.
    torch.testing.assert_close(hidden.grad, gradient @ weight.detach())
    torch.testing.assert_close(weight.grad, gradient.T @ hidden.detach())


def test_overwrite_logits_that_another_op_saved_fails_loudly_instead_of_a_wrong_gradient():
    # tanh's backward reads its output: overwritten logits would give it the gradient as values.
    pre_activation = torch.randn(4, 9, device=DEVICE, requires_grad=True)
    logits = torch.tanh(pre_activation)
    loss = cross_entropy(logits, _targets(4, 9), overwrite_logits=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_overwrite_logits_leaves_logits_without_grad_untouched():
    logits, target = torch.randn(3, 10, device=DEVICE), _targets(3, 10)
    before = logits.clone()
    with launched(FORWARD):
        loss = cross_entropy(logits, target, overwrite_logits=True)
    assert torch.equal(logits, before)
    assert_matches(loss, F.cross_entropy(before.double(), target), torch.float32)


def test_overwrite_logits_under_torch_compile_traces_the_functional_op_into_one_graph():
    torch.manual_seed(8)
    hidden, weight = torch.randn(5, 6, device=DEVICE, requires_grad=True), torch.randn(13, 6, device=DEVICE)
    target = _targets(5, 13, ignored=(0,))

    def step(hidden, target):
        return cross_entropy(hidden @ weight.T, target, overwrite_logits=True)

    expected = F.cross_entropy(hidden.detach().double() @ weight.double().T, target)
    torch._dynamo.reset()
    with launched(FORWARD, BACKWARD):
        loss = torch.compile(step, backend="aot_eager", fullgraph=True)(hidden, target)  # a graph break raises
        loss.backward()
    assert_matches(loss, expected, torch.float32)
    reference = hidden.detach().double().requires_grad_()
    F.cross_entropy(reference @ weight.double().T, target).backward()
    assert_matches(hidden.grad, reference.grad, torch.float32)
