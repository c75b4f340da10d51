"""The kernel tests run Triton's interpreter on CPU tensors unless told otherwise.

Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when a ``fabriclite.kernels.fused_*`` op file is
first imported (importing triton itself earlier does no harm). pytest loads this conftest before it imports any
test module in this folder, and nothing outside ``fabriclite.kernels`` imports the op files, so setting it here is
early enough. ``TRITON_INTERPRET=0 python -m pytest tests/kernels`` runs the same tests compiled on a CUDA device.
"""

import os
import sys
from importlib.util import find_spec

import pytest

_chosen_outside = "TRITON_INTERPRET" in os.environ
os.environ.setdefault("TRITON_INTERPRET", "1")

if find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]  # without triton there is nothing to test here
elif not _chosen_outside and any(name.startswith("fabriclite.kernels.fused_") for name in sys.modules):
    raise RuntimeError(
        "fabriclite's kernels were imported (and compiled for the GPU) before tests/kernels/conftest.py could set "
        "TRITON_INTERPRET=1; set it in the environment, or find the test that imports them first."
    )


@pytest.fixture(autouse=True)
def _compile_the_code_under_test():
    """torch.compile tests compile the kernels' current code. AOT autograd's cache keys a compiled forward and
    backward on the traced forward graph, not on the backward formula a custom op registers, so a changed formula
    (or backward op schema) would otherwise replay the backward compiled from the old code, on this machine only."""
    import torch._functorch.config

    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield
