"""What every kernel test uses: the device, per-dtype tolerances against float64 references, and proof that a
Triton kernel (not some torch fallback) produced the numbers."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from fabriclite.kernels import _common

INTERPRET = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "on", "yes")
DEVICE = torch.device("cpu" if INTERPRET or not torch.cuda.is_available() else "cuda")

# Kernels compute in fp32 and round on store (twice at most: cross-entropy's saved gradient, then its scaled copy),
# so a result is off by a rounding or two of its dtype plus fp32 noise; the absolute part is relative to the largest
# reference value to allow for cancellation. Triton's interpreter casts fp32 to bf16 by truncating (one ulp,
# 2**-7, where the GPU's round-to-nearest-even loses half of that), hence the looser bf16 bound there.
TOLERANCES = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2 if INTERPRET else 1e-2, "atol": 1e-4},
    torch.float16: {"rtol": 2e-3, "atol": 1e-4},
}


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``actual`` (a kernel's output, in ``dtype``) against a float64 reference; NaN or inf never pass."""
    assert actual.dtype == dtype, f"expected a {dtype} result, got {actual.dtype}"
    assert actual.shape == expected.shape, f"expected shape {tuple(expected.shape)}, got {tuple(actual.shape)}"
    assert torch.isfinite(actual).all(), "the kernel produced NaN or inf"
    tolerance = TOLERANCES[dtype]
    scale = max(expected.abs().max().item(), 1e-3) if expected.numel() else 1.0
    torch.testing.assert_close(
        actual.double(), expected.double(), rtol=tolerance["rtol"], atol=tolerance["atol"] * scale
    )


@contextmanager
def launched(*kernels: str) -> Iterator[None]:
    """Fail unless each named ``@triton.jit`` kernel was launched inside the block."""
    before = dict(_common.LAUNCHES)
    yield
    missing = [name for name in kernels if _common.LAUNCHES[name] <= before.get(name, 0)]
    assert not missing, f"these Triton kernels never launched: {missing}"


def leaf_pair(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` in ``dtype`` on DEVICE, and its float64 twin holding the same (rounded) values; both require grad."""
    kernel = t.to(DEVICE, dtype).requires_grad_()
    return kernel, kernel.detach().double().requires_grad_()
