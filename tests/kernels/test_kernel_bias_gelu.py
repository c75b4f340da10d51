import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, assert_matches, launched, leaf_pair

from fabriclite.kernels import bias_gelu, fused_bias_gelu

FORWARD = "_bias_gelu_forward_kernel"
BACKWARD = "_bias_gelu_backward_kernel"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_bias_gelu_and_its_gradients_match_torch(approximate, dtype):
    torch.manual_seed(0)
    x, x_ref = leaf_pair(3 * torch.randn(2, 3, 37), dtype)  # wide enough a range to reach both tails
    bias, bias_ref = leaf_pair(torch.randn(37), dtype)
    upstream = torch.randn(37, 3, 2, dtype=dtype, device=DEVICE).transpose(0, 2)  # not contiguous

    with launched(FORWARD, BACKWARD):
        y = bias_gelu(x, bias, approximate)
        y.backward(upstream)
    expected = F.gelu(x_ref + bias_ref, approximate=approximate)
    expected.backward(upstream.double())

    assert_matches(y, expected, dtype)
    assert_matches(x.grad, x_ref.grad, dtype)
    assert_matches(bias.grad, bias_ref.grad, dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_many_tiles_each_add_their_partial_bias_gradient(monkeypatch, approximate):
    # 4 x 8 tiles over 11 rows of 37: three tile rows (the last partial) by five tile columns (the last partial).
    monkeypatch.setattr(fused_bias_gelu, "BLOCK_N_MAX", 8)
    monkeypatch.setattr(fused_bias_gelu, "TILE", 32)
    torch.manual_seed(1)
    x, x_ref = leaf_pair(2 * torch.randn(11, 37), torch.float32)
    bias, bias_ref = leaf_pair(torch.randn(37), torch.float32)

    with launched(FORWARD, BACKWARD):
        y = bias_gelu(x, bias, approximate)
        y.sum().backward()  # an expanded, stride-0 upstream gradient
    expected = F.gelu(x_ref + bias_ref, approximate=approximate)
    expected.sum().backward()

    assert_matches(y, expected, torch.float32)
    assert_matches(x.grad, x_ref.grad, torch.float32)
    assert_matches(bias.grad, bias_ref.grad, torch.float32)


def test_a_single_row_and_a_wider_bias_dtype_promote_like_torch():
    torch.manual_seed(2)
    x, x_ref = leaf_pair(torch.randn(1, 23), torch.bfloat16)
    bias, bias_ref = leaf_pair(torch.randn(23), torch.float32)

    with launched(FORWARD, BACKWARD):
        y = bias_gelu(x, bias)
        y.sum().backward()
    assert y.dtype == (x.detach() + bias.detach()).dtype == torch.float32
    expected = F.gelu(x_ref + bias_ref)
    expected.sum().backward()

    assert_matches(y, expected, torch.float32)
    assert_matches(x.grad, x_ref.grad, torch.bfloat16)
    assert_matches(bias.grad, bias_ref.grad, torch.float32)


def test_bad_arguments_are_refused_with_the_valid_choices():
    x = torch.randn(2, 5, device=DEVICE)
    with pytest.raises(ValueError, match="approximate="):
        bias_gelu(x, torch.zeros(5, device=DEVICE), approximate="fast")
    with pytest.raises(ValueError, match="1-D bias"):
        bias_gelu(x, torch.zeros(4, device=DEVICE))
