"""The kernel tests run compiled on a CUDA GPU, and under Triton's interpreter on CPU tensors where there is none.

``TRITON_INTERPRET`` set in the environment decides instead (``TRITON_INTERPRET=1`` runs the interpreter on a GPU
machine too). Triton reads it when a kernel is decorated, i.e. when a ``fabriclite.kernels`` op file is first
imported (importing triton itself earlier does no harm). pytest loads this conftest before it imports any test
module in this folder, and nothing outside ``fabriclite.kernels`` imports the op files, so setting it here is early
enough.
"""

import os
import sys
from importlib.util import find_spec

import pytest
import torch

_chosen_outside = "TRITON_INTERPRET" in os.environ
# The interpreter only where nothing can compile the kernels (triton 3.6's interpreter also fails under numpy 2.5
# on a GPU machine, where the compiled kernels pass).
os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
_KERNEL_FILES = ("fabriclite.kernels.fused_", "fabriclite.kernels._norm")

if find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]  # without triton there is nothing to test here
elif not _chosen_outside and any(name.startswith(_KERNEL_FILES) for name in sys.modules):
    raise RuntimeError(
        "fabriclite's kernels were imported before tests/kernels/conftest.py could set TRITON_INTERPRET; set it in "
        "the environment, or find the test that imports them first."
    )


@pytest.fixture(autouse=True)
def _compile_the_code_under_test():
    """torch.compile tests compile the kernels' current code. AOT autograd's cache keys a compiled forward and
    backward on the traced forward graph, not on the backward formula a custom op registers, so a changed formula
    (or backward op schema) would otherwise replay the backward compiled from the old code, on this machine only."""
    import torch._functorch.config

    with torch._functorch.config.patch(enable_autograd_cache=False):
        yield
