"""Row offsets past 2**31 elements: tokens x vocabulary reaches that (8192 x 262144), and an int32 offset would wrap
to a wrong (or unmapped) address. Three rows 2**30 elements apart put the last one at element 2**31: 4 GiB of
bf16 reserved but barely touched (the view's rows are all that is written or read), so this runs in a child
process, where a wrapped offset that segfaults fails this test instead of ending the whole run."""

from helpers import run_python
from kernel_checks import DEVICE

import pytest

CHILD = r"""
import sys
import torch
import torch.nn.functional as F
from fabriclite.kernels import add_rms_norm, bias_gelu, cross_entropy, layer_norm, rms_norm, rope, swiglu

device, row, n = sys.argv[1], 2**30, 37
try:
    storage = torch.empty(2 * row + n, dtype=torch.bfloat16, device=device)
except RuntimeError:
    sys.exit("SKIP: cannot reserve 4 GiB")

def far_rows(values):
    view = storage.as_strided((3, n), (row, 1))
    with torch.no_grad():
        view.copy_(values)
    return view.requires_grad_()

def check(name, actual, expected):
    torch.testing.assert_close(actual.double(), expected, rtol=2e-2, atol=1e-3 * expected.abs().max().item(),
                               msg=lambda m: f"{name}: {m}")

torch.manual_seed(0)
values = torch.randn(3, n, device=device).bfloat16()
weight = torch.randn(n, device=device).bfloat16()
target = torch.tensor([1, 5, 36], device=device)
reference = values.double().requires_grad_()
angles = torch.arange(3, device=device)[:, None] * torch.rand(36, device=device)
cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()

def as_heads(x):
    return x[None, :, None, :36]  # (B, T, H, D) = (1, 3, 1, 36), positions 2**30 elements apart

def rotated(x):
    half = torch.cat((-x[..., 18:], x[..., :18]), dim=-1)
    return x * cos.double()[:, None] + half * sin.double()[:, None]

logits = far_rows(values)
check("cross_entropy", cross_entropy(logits, target, reduction="none"), F.cross_entropy(reference, target, reduction="none"))

for name, op, torch_op in [
    ("layer_norm", lambda x: layer_norm(x, (n,), weight), lambda x: F.layer_norm(x, (n,), weight.double())),
    ("rms_norm", lambda x: rms_norm(x, weight, 1e-6), lambda x: F.rms_norm(x, (n,), weight.double(), 1e-6)),
    ("bias_gelu", lambda x: bias_gelu(x, weight), lambda x: F.gelu(x + weight.double())),
    ("add_rms_norm", lambda x: add_rms_norm(x, x, weight, 1e-6)[0], lambda x: F.rms_norm(2 * x, (n,), weight.double(), 1e-6)),
    ("swiglu", lambda x: swiglu(x, x), lambda x: F.silu(x) * x),
    ("rope", lambda x: rope(as_heads(x), as_heads(x), cos, sin)[0], lambda x: rotated(as_heads(x))),
]:
    x = far_rows(values)
    reference.grad = None
    y, expected = op(x), torch_op(reference)
    y.square().sum().backward()
    expected.square().sum().backward()
    check(name, y, expected)
    check(name + " backward", x.grad, reference.grad)
print("ok")
"""


def test_rows_past_2_to_the_31_elements_are_addressed_with_int64_offsets():
    result = run_python("-c", CHILD, str(DEVICE), timeout=240, check=False)
    if "SKIP" in result.stderr:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stdout + result.stderr
