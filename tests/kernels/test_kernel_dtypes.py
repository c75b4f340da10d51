"""Which dtypes the kernels take. They load float32, bfloat16 and float16 and compute in fp32; a float64 input would
lose its precision in silence, so every op refuses it (and any other dtype) with an error naming what works."""

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, assert_matches, launched, leaf_pair

from fabriclite.kernels import RMSNorm, add_layer_norm, bias_gelu, cross_entropy, layer_norm, rms_norm


def _t(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=DEVICE)


F64 = torch.float64
TARGET = torch.tensor([0, 3, 6], device=DEVICE)
REFUSED = {
    "cross_entropy": lambda: cross_entropy(_t(3, 7, dtype=F64), TARGET),
    "rms_norm": lambda: rms_norm(_t(3, 7, dtype=F64), _t(7, dtype=F64)),
    "rms_norm float64 weight": lambda: rms_norm(_t(3, 7), _t(7, dtype=F64)),
    "RMSNorm": lambda: RMSNorm(7, dtype=F64, device=DEVICE)(_t(3, 7, dtype=F64)),
    "layer_norm": lambda: layer_norm(_t(3, 7, dtype=F64), 7),
    "layer_norm float64 bias": lambda: layer_norm(_t(3, 7), 7, _t(7), _t(7, dtype=F64)),
    "add_layer_norm float64 residual": lambda: add_layer_norm(_t(3, 7), _t(3, 7, dtype=F64)),
    "bias_gelu float64 bias": lambda: bias_gelu(_t(3, 7), _t(7, dtype=F64)),
    "bias_gelu int": lambda: bias_gelu(torch.ones(3, 7, dtype=torch.int32, device=DEVICE), _t(7)),
}


@pytest.mark.parametrize("call", REFUSED.values(), ids=REFUSED.keys())
def test_a_float64_or_other_unsupported_input_is_refused_naming_the_supported_dtypes(call):
    with pytest.raises(TypeError, match=r"got a torch\.(float64|int32) tensor.*float32, bfloat16 and float16"):
        call()


FLOAT16_OPS = {
    "rms_norm": (lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: F.rms_norm(x, (37,), w, 1e-6)),
    "layer_norm": (lambda x, w: layer_norm(x, 37, w, w), lambda x, w: F.layer_norm(x, (37,), w, w)),
    "bias_gelu": (bias_gelu, lambda x, w: F.gelu(x + w)),
}


@pytest.mark.parametrize(("op", "torch_op"), FLOAT16_OPS.values(), ids=FLOAT16_OPS.keys())
def test_float16_is_computed_in_fp32_like_bf16(op, torch_op):
    torch.manual_seed(0)
    x, x_ref = leaf_pair(torch.randn(5, 37), torch.float16)
    weight, weight_ref = leaf_pair(torch.randn(37), torch.float16)

    y = op(x, weight)
    y.sum().backward()
    expected = torch_op(x_ref, weight_ref)
    expected.sum().backward()

    assert_matches(y, expected, torch.float16)
    assert_matches(x.grad, x_ref.grad, torch.float16)
    assert_matches(weight.grad, weight_ref.grad, torch.float16)


def test_float16_cross_entropy_is_computed_in_fp32_like_bf16():
    torch.manual_seed(1)
    logits, reference = leaf_pair(3 * torch.randn(5, 37), torch.float16)
    target = torch.randint(0, 37, (5,), device=DEVICE)

    with launched("_cross_entropy_forward_kernel", "_cross_entropy_backward_kernel"):
        loss = cross_entropy(logits, target)
        loss.backward()
    expected = F.cross_entropy(reference, target)
    expected.backward()

    assert_matches(loss, expected, torch.float16)
    assert_matches(logits.grad, reference.grad, torch.float16)
