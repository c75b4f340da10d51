import os

# The kernels run through Triton's interpreter on CPU tensors. Triton reads this when it is imported and when a
# kernel is decorated, and torch.compile may import triton early, so it is set before any test module is imported.
# On a CUDA machine, TRITON_INTERPRET=0 runs the kernel tests compiled.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
