"""The norm backward's two designs (kernels/_norm.py): tiles of several rows with the next tile's loads in flight,
and the row loop it replaced, kept for the wide rows and for timing side by side. Both must give the gradients of
the definition for every form of the op, in every dtype the kernels take, on ranges of rows that do not divide into
whole tiles or whole programs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import DEVICE, assert_matches, launched, leaf_pair

from fabriclite.kernels import _norm, add_layer_norm, add_rms_norm, layer_norm, rms_norm

BACKWARD = "_norm_backward_kernel"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# 71 rows: in the interpreter 3 programs of 32 rows (width 37, tiles of 16 rows; the last has 7) or 4 of 18 (width
# 300, tiles of 2; the last has 17): partial tiles.
ROWS = 71


def _rms_reference(x, weight, eps):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * weight if weight is not None else y


# name: (width, weight, bias, residual, rms)
FORMS = {
    "layer_norm, weight and bias, width 300": (300, True, True, False, False),
    "layer_norm, no affine, width 37": (37, False, False, False, False),
    "rms_norm, weight, width 37": (37, True, False, False, True),
    "rms_norm, no weight, width 300": (300, False, False, False, True),
    "add_layer_norm, weight and bias, width 37": (37, True, True, True, False),
    "add_rms_norm, weight, width 300": (300, True, False, True, True),
}


# The tiles in every dtype; the row loop (the design the existing tests covered before) in bf16.
DESIGNS = [("tiles", dtype) for dtype in DTYPES] + [("row loop", torch.bfloat16)]


@pytest.mark.parametrize("design, dtype", DESIGNS, ids=[f"{d} {str(t)[6:]}" for d, t in DESIGNS])
@pytest.mark.parametrize("form", FORMS)
def test_both_backward_designs_give_the_gradients_of_the_definition(form, design, dtype, monkeypatch):
    monkeypatch.setattr(_norm, "ROW_LOOP_BACKWARD", design == "row loop")
    width, with_weight, with_bias, with_residual, rms = FORMS[form]
    torch.manual_seed(0)
    x, x_ref = leaf_pair(2 * torch.randn(ROWS, width) + 0.5, dtype)
    residual = torch.randn(ROWS, width, dtype=dtype, device=DEVICE, requires_grad=True) if with_residual else None
    weight, weight_ref = leaf_pair(1 + torch.randn(width), dtype) if with_weight else (None, None)
    bias, bias_ref = leaf_pair(torch.randn(width), dtype) if with_bias else (None, None)
    upstream = torch.randn(ROWS, width, dtype=dtype, device=DEVICE)
    upstream_sum = torch.randn(ROWS, width, dtype=dtype, device=DEVICE)

    with launched(BACKWARD):
        if with_residual:
            y, summed = add_rms_norm(x, residual, weight, 1e-6) if rms else add_layer_norm(x, residual, weight, bias)
            torch.autograd.backward((y, summed), (upstream, upstream_sum))
        else:
            y = rms_norm(x, weight, 1e-6) if rms else layer_norm(x, (width,), weight, bias)
            y.backward(upstream)
    # With a residual the kernel normalizes the sum it returns (rounded to dtype); the reference starts from that
    # same sum, so that the rounding of the add is not counted as an error of the backward.
    hidden = summed.detach().double().requires_grad_() if with_residual else x_ref
    if rms:
        expected = _rms_reference(hidden, weight_ref, 1e-6)
    else:
        expected = F.layer_norm(hidden, (width,), weight_ref, bias_ref)
    expected.backward(upstream.double())

    d_input = hidden.grad + upstream_sum.double() if with_residual else x_ref.grad
    assert_matches(x.grad, d_input, dtype)
    if with_residual:
        assert_matches(residual.grad, d_input, dtype)
    for leaf, reference in ((weight, weight_ref), (bias, bias_ref)):
        if leaf is not None:
            assert_matches(leaf.grad, reference.grad, dtype)


def test_the_designs_differ_only_in_their_tiles_and_give_the_same_gradients(monkeypatch):
    # Both designs sum the weight gradient in fp32 over the same programs' rows: only the order within a program
    # differs, so fp32 results agree to fp32 rounding, which a wrong tile offset would not.
    torch.manual_seed(1)
    x = torch.randn(ROWS, 37, device=DEVICE, requires_grad=True)
    weight = torch.randn(37, device=DEVICE, requires_grad=True)
    bias = torch.randn(37, device=DEVICE, requires_grad=True)
    upstream = torch.randn(ROWS, 37, device=DEVICE)
    grads = {}
    for row_loop in (False, True):
        monkeypatch.setattr(_norm, "ROW_LOOP_BACKWARD", row_loop)
        grads[row_loop] = torch.autograd.grad(layer_norm(x, (37,), weight, bias), (x, weight, bias), upstream)
    for tiled, looped in zip(grads[False], grads[True]):
        torch.testing.assert_close(tiled, looped, rtol=1e-5, atol=1e-5)


def test_narrow_rows_share_a_tile_of_eight_elements_a_thread_and_wide_rows_take_the_row_loop():
    # (block, rows per tile, num_warps, prefetch, programs per multiprocessor)
    assert _norm._backward_sizes(37, False) == (64, 16, 4, True, 8)
    assert _norm._backward_sizes(768, False) == (1024, 1, 4, True, 8)
    assert _norm._backward_sizes(4096, False) == (4096, 1, 16, True, 4)
    assert _norm._backward_sizes(8192, False) == (8192, 1, 16, True, 4)
    assert _norm._backward_sizes(8193, False) == (16384, 1, 16, False, 4)
    assert _norm._backward_sizes(768, True) == (1024, 1, 4, False, 4)  # the row loop as it was


def test_rows_wider_than_the_tiles_take_the_row_loop_and_stay_correct():
    torch.manual_seed(2)
    x, x_ref = leaf_pair(torch.randn(3, 8200), torch.float32)
    weight, weight_ref = leaf_pair(torch.randn(8200), torch.float32)
    upstream = torch.randn(3, 8200, device=DEVICE)

    with launched(BACKWARD):
        rms_norm(x, weight, 1e-6).backward(upstream)
    _rms_reference(x_ref, weight_ref, 1e-6).backward(upstream.double())

    assert_matches(x.grad, x_ref.grad, torch.float32)
    assert_matches(weight.grad, weight_ref.grad, torch.float32)


@pytest.mark.parametrize("rms", [False, True], ids=["layer_norm", "rms_norm"])
def test_no_rows_give_zero_parameter_gradients_as_torch_does(rms):
    x = torch.randn(0, 8, device=DEVICE, requires_grad=True)
    weight = torch.randn(8, device=DEVICE, requires_grad=True)
    bias = torch.randn(8, device=DEVICE, requires_grad=True)
    y = rms_norm(x, weight, 1e-6) if rms else layer_norm(x, (8,), weight, bias)
    y.sum().backward()
    assert torch.equal(weight.grad, torch.zeros(8, device=DEVICE))
    if not rms:
        assert torch.equal(bias.grad, torch.zeros(8, device=DEVICE))
