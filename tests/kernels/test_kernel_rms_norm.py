from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, assert_matches, launched, leaf_pair

from fabriclite.kernels import RMSNorm, rms_norm

pytestmark = pytest.mark.torch_versions  # also run on the other torch versions CI tests

FORWARD = "_norm_forward_kernel"
BACKWARD = "_norm_backward_kernel"
DTYPES = [torch.float32, torch.bfloat16]


def _reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The definition, in float64: x * rsqrt(mean(x ** 2) + eps) * weight."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight if weight is not None else y


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no weight"])
def test_rms_norm_and_its_gradients_match_the_definition(with_weight, dtype):
    torch.manual_seed(0)
    x, x_ref = leaf_pair(2 * torch.randn(3, 4, 37) + 0.5, dtype)
    weight, weight_ref = leaf_pair(torch.randn(37), dtype) if with_weight else (None, None)
    upstream = torch.randn(37, 4, 3, dtype=dtype, device=DEVICE).transpose(0, 2)  # not contiguous

    with launched(FORWARD, BACKWARD):
        y = rms_norm(x, weight, eps=1e-6)
        y.backward(upstream)
    expected = _reference(x_ref, weight_ref, 1e-6)
    expected.backward(upstream.double())

    assert_matches(y, expected, dtype)
    assert_matches(x.grad, x_ref.grad, dtype)
    if with_weight:
        assert_matches(weight.grad, weight_ref.grad, dtype)


def _torch_fp32(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None) -> torch.Tensor:
    """torch's own ``F.rms_norm`` computed in fp32, as torch computes it for fp32, bf16 and fp16 inputs; with
    eps=None torch picks the eps itself, so this checks our default against torch's, not against our formula."""
    return F.rms_norm(x.float(), x.shape[-1:], weight.float() if weight is not None else None, eps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_single_row_with_an_expanded_upstream_gradient_and_torch_default_eps(dtype):
    torch.manual_seed(1)
    x, x_ref = leaf_pair(torch.randn(1, 19), dtype)
    weight, weight_ref = leaf_pair(torch.randn(19), dtype)

    with launched(FORWARD, BACKWARD):
        y = rms_norm(x, weight)  # eps=None: the eps torch picks
        y.sum().backward()
    expected = _torch_fp32(x_ref, weight_ref, None)
    expected.sum().backward()

    assert_matches(y, expected, dtype)
    assert_matches(x.grad, x_ref.grad, dtype)
    assert_matches(weight.grad, weight_ref.grad, dtype)


def test_default_eps_on_bf16_is_fp32_eps_as_torch_computes_bf16_in_fp32():
    # mean(x ** 2) = 0.0025 here: bf16's own eps (0.0078) would swamp it, fp32's (1.2e-7) does not.
    torch.manual_seed(4)
    x, x_ref = leaf_pair(0.05 * torch.randn(8, 64), torch.bfloat16)
    weight, weight_ref = leaf_pair(1 + 0.1 * torch.randn(64), torch.bfloat16)
    upstream = torch.randn(8, 64, dtype=torch.bfloat16, device=DEVICE)

    with launched(FORWARD, BACKWARD):
        y = rms_norm(x, weight)
        y.backward(upstream)
    expected = _torch_fp32(x_ref, weight_ref, None)
    expected.backward(upstream.double())

    assert_matches(y, expected, torch.bfloat16)
    assert_matches(x.grad, x_ref.grad, torch.bfloat16)
    assert_matches(weight.grad, weight_ref.grad, torch.bfloat16)


def test_matches_torch_rms_norm_over_a_multi_dimensional_shape():
    torch.manual_seed(2)
    x, x_ref = leaf_pair(torch.randn(3, 5, 7), torch.float32)
    weight, weight_ref = leaf_pair(torch.randn(5, 7), torch.float32)

    with launched(FORWARD, BACKWARD):
        y = rms_norm(x, weight, eps=1e-5)
        y.mean().backward()
    expected = F.rms_norm(x_ref, (5, 7), weight_ref, eps=1e-5)
    expected.mean().backward()

    assert_matches(y, expected, torch.float32)
    assert_matches(x.grad, x_ref.grad, torch.float32)
    assert_matches(weight.grad, weight_ref.grad, torch.float32)


def test_the_module_has_the_parameters_and_state_dict_of_nn_rms_norm():
    torch.manual_seed(3)
    reference = torch.nn.RMSNorm(13, eps=1e-6, device=DEVICE)
    torch.nn.init.normal_(reference.weight)
    module = RMSNorm(13, eps=1e-6, device=DEVICE)
    module.load_state_dict(reference.state_dict())
    assert list(module.state_dict()) == list(reference.state_dict())
    assert (module.normalized_shape, module.eps, module.elementwise_affine) == ((13,), 1e-6, True)
    x = torch.randn(4, 13, device=DEVICE)
    with launched(FORWARD):
        assert_matches(module(x), reference.double()(x.double()), torch.float32)


def test_an_input_that_does_not_end_in_the_normalized_shape_is_refused():
    with pytest.raises(ValueError, match="ending in those sizes"):
        rms_norm(torch.randn(2, 6, device=DEVICE), torch.ones(5, device=DEVICE))
