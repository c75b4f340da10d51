from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, assert_matches, launched, leaf_pair

from fabriclite.kernels import add_rms_norm

FORWARD = "_norm_forward_kernel"
BACKWARD = "_norm_backward_kernel"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
FP32_EPS = torch.finfo(torch.float32).eps


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no weight"])
@pytest.mark.parametrize("sum_used", [True, False], ids=["both outputs used", "normalized output only"])
def test_add_rms_norm_returns_the_sum_and_gradients_of_both_outputs(sum_used, with_weight, dtype):
    torch.manual_seed(0)
    # 3 x 4 rows of odd width 37: more rows than the backward has programs, so weight gradients add up partials.
    x, x_ref = leaf_pair(torch.randn(3, 37, 4).transpose(1, 2) + 0.5, dtype)  # x not contiguous
    residual, residual_ref = leaf_pair(2 * torch.randn(3, 4, 37), dtype)
    weight, weight_ref = leaf_pair(torch.randn(37), dtype) if with_weight else (None, None)
    dy = torch.randn(37, 4, 3, dtype=dtype, device=DEVICE).transpose(0, 2)  # not contiguous
    dsum = torch.randn(3, 4, 37, dtype=dtype, device=DEVICE)

    with launched(FORWARD, BACKWARD):
        y, summed = add_rms_norm(x, residual, weight, eps=1e-6)
        loss = (y * dy).sum() + ((summed * dsum).sum() if sum_used else 0)
        loss.backward()

    assert_matches(summed, x_ref + residual_ref, dtype)
    # The kernel normalizes the sum it returns (rounded to dtype), as rms_norm(x + residual) does in torch; the
    # reference starts from that same sum so the rounding of the add is not counted twice.
    summed_ref = summed.detach().double().requires_grad_()
    expected = F.rms_norm(summed_ref, (37,), weight_ref, eps=1e-6)
    (expected * dy.double()).sum().backward()
    assert_matches(y, expected, dtype)
    d_input = summed_ref.grad + (dsum.double() if sum_used else 0)
    assert_matches(x.grad, d_input, dtype)
    assert_matches(residual.grad, d_input, dtype)
    if with_weight:
        assert_matches(weight.grad, weight_ref.grad, dtype)


def test_fp32_matches_torch_add_then_rms_norm_end_to_end():
    torch.manual_seed(1)
    x, x_ref = leaf_pair(torch.randn(2, 7, 24), torch.float32)
    residual, residual_ref = leaf_pair(torch.randn(2, 7, 24), torch.float32)
    weight, weight_ref = leaf_pair(torch.randn(24), torch.float32)

    with launched(FORWARD, BACKWARD):
        y, summed = add_rms_norm(x, residual, weight, eps=1e-5)
        (y.square().sum() + summed.sum()).backward()  # the sum's upstream gradient is expanded (strides 0)
    summed_ref = x_ref + residual_ref
    expected = F.rms_norm(summed_ref, (24,), weight_ref, eps=1e-5)
    (expected.square().sum() + summed_ref.sum()).backward()

    assert_matches(y, expected, torch.float32)
    assert_matches(summed, summed_ref, torch.float32)
    for leaf, reference in ((x, x_ref), (residual, residual_ref), (weight, weight_ref)):
        assert_matches(leaf.grad, reference.grad, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_default_eps_is_fp32_eps_as_torch_computes_rms_norm_in_fp32(dtype):
    # mean(x ** 2) = 0.0025 here: bf16's own eps (0.0078) would swamp it, fp32's (1.2e-7) does not.
    torch.manual_seed(2)
    x, _ = leaf_pair(0.03 * torch.randn(1, 64), dtype)
    residual, _ = leaf_pair(0.03 * torch.randn(1, 64), dtype)
    weight, weight_ref = leaf_pair(1 + 0.1 * torch.randn(64), dtype)

    with launched(FORWARD, BACKWARD):
        y, summed = add_rms_norm(x, residual, weight)
        y.sum().backward()
    summed_ref = summed.detach().double().requires_grad_()
    expected = F.rms_norm(summed_ref.float(), (64,), weight_ref.float(), None)  # torch picks the eps
    expected.sum().backward()

    assert_matches(y, expected, dtype)
    assert_matches(x.grad, summed_ref.grad, dtype)
    assert_matches(weight.grad, weight_ref.grad, dtype)


def test_bf16_input_with_an_fp32_residual_promotes_like_torch():
    torch.manual_seed(3)
    x, x_ref = leaf_pair(torch.randn(5, 19), torch.bfloat16)
    residual, residual_ref = leaf_pair(torch.randn(5, 19), torch.float32)
    weight, weight_ref = leaf_pair(torch.randn(19), torch.float32)

    with launched(FORWARD, BACKWARD):
        y, summed = add_rms_norm(x, residual, weight, 1e-6)
        (y.sum() + summed.sum()).backward()
    assert summed.dtype == (x.detach() + residual.detach()).dtype == torch.float32
    summed_ref = x_ref + residual_ref
    expected = F.rms_norm(summed_ref, (19,), weight_ref, 1e-6)
    (expected.sum() + summed_ref.sum()).backward()

    assert_matches(y, expected, torch.float32)
    assert_matches(x.grad, x_ref.grad, torch.bfloat16)  # each gradient in its input's dtype
    assert_matches(residual.grad, residual_ref.grad, torch.float32)
    assert_matches(weight.grad, weight_ref.grad, torch.float32)


def test_bad_arguments_are_refused_saying_what_fits():
    x = torch.randn(2, 5, device=DEVICE)
    with pytest.raises(ValueError, match="one shape"):
        add_rms_norm(x, torch.randn(5, device=DEVICE))
    with pytest.raises(ValueError, match="1-D weight as long as it"):
        add_rms_norm(x, x, torch.ones(4, device=DEVICE))
    with pytest.raises(TypeError, match=r"got a torch\.float64 tensor.*float32, bfloat16 and float16"):
        add_rms_norm(x, x.double())


def _block(x, residual, weight):
    normed, hidden = add_rms_norm(x, residual, weight, 1e-6)
    return (normed * hidden).sum()


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_traces_add_rms_norm_into_one_graph_with_its_backward(backend):
    torch.manual_seed(5)
    leaves = [torch.randn(*shape, device=DEVICE, requires_grad=True) for shape in ((4, 9), (4, 9), (9,))]
    expected = _block(*leaves)
    expected_grads = torch.autograd.grad(expected, leaves)

    torch._dynamo.reset()
    compiled = torch.compile(_block, backend=backend, fullgraph=True)  # a graph break raises here
    with launched(FORWARD, BACKWARD):
        loss = compiled(*leaves)
        grads = torch.autograd.grad(loss, leaves)

    torch.testing.assert_close(loss, expected)
    for grad, expected_grad in zip(grads, expected_grads):
        torch.testing.assert_close(grad, expected_grad)
