import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, assert_matches, launched, leaf_pair
from torch.utils._python_dispatch import TorchDispatchMode

from fabriclite.kernels import LayerNorm, add_layer_norm, layer_norm

FORWARD = "_norm_forward_kernel"
BACKWARD = "_norm_backward_kernel"
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", ["weight and bias", "weight only", "none"])
def test_layer_norm_and_its_gradients_match_torch(affine, dtype):
    torch.manual_seed(0)
    # 3 x 4 rows of odd width 37: more rows than the backward has programs, so weight gradients add up partials.
    x, x_ref = leaf_pair(2 * torch.randn(3, 4, 37) + 1, dtype)
    weight, weight_ref = leaf_pair(torch.randn(37), dtype) if affine != "none" else (None, None)
    bias, bias_ref = leaf_pair(torch.randn(37), dtype) if affine == "weight and bias" else (None, None)
    upstream = torch.randn(37, 4, 3, dtype=dtype, device=DEVICE).transpose(0, 2)  # not contiguous

    with launched(FORWARD, BACKWARD):
        y = layer_norm(x, (37,), weight, bias, eps=1e-5)
        y.backward(upstream)
    expected = F.layer_norm(x_ref, (37,), weight_ref, bias_ref, eps=1e-5)
    expected.backward(upstream.double())

    assert_matches(y, expected, dtype)
    assert_matches(x.grad, x_ref.grad, dtype)
    for leaf, reference in ((weight, weight_ref), (bias, bias_ref)):
        if leaf is not None:
            assert_matches(leaf.grad, reference.grad, dtype)


def test_bf16_input_with_fp32_parameters_as_under_autocast():
    torch.manual_seed(6)
    x, x_ref = leaf_pair(torch.randn(5, 37), torch.bfloat16)
    weight, weight_ref = leaf_pair(torch.randn(37), torch.float32)
    bias, bias_ref = leaf_pair(torch.randn(37), torch.float32)

    with launched(FORWARD, BACKWARD):
        y = layer_norm(x, (37,), weight, bias)
        y.sum().backward()
    expected = F.layer_norm(x_ref, (37,), weight_ref, bias_ref)
    expected.sum().backward()

    assert_matches(y, expected, torch.bfloat16)  # the output keeps the input's dtype, as F.layer_norm does
    assert_matches(x.grad, x_ref.grad, torch.bfloat16)
    assert_matches(weight.grad, weight_ref.grad, torch.float32)
    assert_matches(bias.grad, bias_ref.grad, torch.float32)


def test_a_multi_dimensional_normalized_shape_normalizes_the_trailing_dimensions():
    torch.manual_seed(1)
    x, x_ref = leaf_pair(torch.randn(3, 5, 7), torch.float32)
    weight, weight_ref = leaf_pair(torch.randn(5, 7), torch.float32)
    bias, bias_ref = leaf_pair(torch.randn(5, 7), torch.float32)

    with launched(FORWARD, BACKWARD):
        y = layer_norm(x, (5, 7), weight, bias, eps=1e-3)
        y.mean().backward()
    expected = F.layer_norm(x_ref, (5, 7), weight_ref, bias_ref, eps=1e-3)
    expected.mean().backward()

    assert_matches(y, expected, torch.float32)
    for leaf, reference in ((x, x_ref), (weight, weight_ref), (bias, bias_ref)):
        assert_matches(leaf.grad, reference.grad, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_single_row_with_an_expanded_upstream_gradient(dtype):
    torch.manual_seed(2)
    x, x_ref = leaf_pair(torch.randn(1, 19), dtype)
    weight, weight_ref = leaf_pair(torch.randn(19), dtype)
    bias, bias_ref = leaf_pair(torch.randn(19), dtype)

    with launched(FORWARD, BACKWARD):
        (layer_norm(x, 19, weight, bias) * 1).sum().backward()  # the op sees a stride-0 expanded gradient
    (F.layer_norm(x_ref, (19,), weight_ref, bias_ref) * 1).sum().backward()

    for leaf, reference in ((x, x_ref), (weight, weight_ref), (bias, bias_ref)):
        assert_matches(leaf.grad, reference.grad, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sum_used", [True, False], ids=["both outputs used", "normalized output only"])
def test_add_layer_norm_returns_the_sum_and_gradients_of_both_outputs(dtype, sum_used):
    torch.manual_seed(3)
    x, x_ref = leaf_pair(torch.randn(6, 37), dtype)
    residual, residual_ref = leaf_pair(torch.randn(6, 37), dtype)
    weight, weight_ref = leaf_pair(torch.randn(37), dtype)
    bias, bias_ref = leaf_pair(torch.randn(37), dtype)
    dy = torch.randn(6, 37, dtype=dtype, device=DEVICE)
    dsum = torch.randn(6, 37, dtype=dtype, device=DEVICE)

    with launched(FORWARD, BACKWARD):
        y, summed = add_layer_norm(x, residual, weight, bias, eps=1e-5)
        loss = (y * dy).sum() + ((summed * dsum).sum() if sum_used else 0)
        loss.backward()

    assert_matches(summed, x_ref + residual_ref, dtype)
    # The kernel normalizes the sum it returns (rounded to dtype), as layer_norm(x + residual) does in torch; the
    # reference starts from that same sum so the rounding of the add is not counted twice.
    summed_ref = summed.detach().double().requires_grad_()
    expected = F.layer_norm(summed_ref, (37,), weight_ref, bias_ref, eps=1e-5)
    (expected * dy.double()).sum().backward()
    assert_matches(y, expected, dtype)
    d_input = summed_ref.grad + (dsum.double() if sum_used else 0)
    assert_matches(x.grad, d_input, dtype)
    assert_matches(residual.grad, d_input, dtype)
    assert_matches(weight.grad, weight_ref.grad, dtype)
    assert_matches(bias.grad, bias_ref.grad, dtype)


def test_add_layer_norm_without_affine_parameters():
    torch.manual_seed(4)
    x, x_ref = leaf_pair(torch.randn(2, 3, 11), torch.float32)
    residual, residual_ref = leaf_pair(torch.randn(2, 3, 11), torch.float32)
    with launched(FORWARD, BACKWARD):
        y, summed = add_layer_norm(x, residual)
        (y.sum() + summed.sum()).backward()
    expected_sum = x_ref + residual_ref
    expected = F.layer_norm(expected_sum, (11,))
    (expected.sum() + expected_sum.sum()).backward()
    assert_matches(y, expected, torch.float32)
    assert_matches(summed, expected_sum, torch.float32)
    assert_matches(x.grad, x_ref.grad, torch.float32)
    assert_matches(residual.grad, residual_ref.grad, torch.float32)


@pytest.mark.parametrize("bias", [True, False])
def test_the_module_has_the_parameters_and_state_dict_of_nn_layer_norm(bias):
    torch.manual_seed(5)
    reference = torch.nn.LayerNorm(13, eps=1e-6, bias=bias, device=DEVICE)
    torch.nn.init.normal_(reference.weight)
    module = LayerNorm(13, eps=1e-6, bias=bias, device=DEVICE)
    module.load_state_dict(reference.state_dict())
    assert list(module.state_dict()) == list(reference.state_dict())
    assert (module.normalized_shape, module.eps, module.elementwise_affine) == ((13,), 1e-6, True)
    x = torch.randn(4, 13, device=DEVICE)
    with launched(FORWARD):
        assert_matches(module(x), reference.double()(x.double()), torch.float32)


def test_rows_wider_than_one_block_are_refused_with_the_limit():
    with pytest.raises(ValueError, match="at most 65536"):
        layer_norm(torch.randn(1, 65537, device=DEVICE), (65537,))


def test_add_layer_norm_refuses_broadcasting():
    with pytest.raises(ValueError, match="one shape"):
        add_layer_norm(torch.randn(2, 5, device=DEVICE), torch.randn(5, device=DEVICE))


class _RecordOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_an_eager_call_launches_the_kernels_without_dispatching_the_custom_op():
    # The custom op costs hundreds of microseconds of Python per call on a GPU; eager calls go around it.
    x = torch.randn(3, 7, device=DEVICE, requires_grad=True)
    weight = torch.randn(7, device=DEVICE, requires_grad=True)
    with _RecordOps() as recorded, launched(FORWARD, BACKWARD):
        layer_norm(x, 7, weight).sum().backward()
    assert not [name for name in recorded.names if name.startswith("fabriclite")], recorded.names


def test_add_layer_norm_with_only_the_sum_used_passes_its_gradient_to_both_inputs():
    x = torch.randn(3, 7, device=DEVICE, requires_grad=True)
    residual = torch.randn(3, 7, device=DEVICE, requires_grad=True)
    weight = torch.randn(7, device=DEVICE, requires_grad=True)
    _, summed = add_layer_norm(x, residual, weight)
    (3 * summed).sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0)) and torch.equal(residual.grad, torch.full_like(x, 3.0))
    assert torch.equal(weight.grad, torch.zeros_like(weight))
