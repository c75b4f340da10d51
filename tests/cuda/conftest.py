"""The GPU tests: ``python -m pytest -m gpu tests/cuda`` on a CUDA machine; without one they are skipped
(tests/conftest.py) and their CPU twins run the same checks at tiny sizes.

cuBLAS reads CUBLAS_WORKSPACE_CONFIG when it is first used; deterministic algorithms (the parity tests) refuse to run
matmuls on CUDA without it, so it is set here, before any test touches the GPU. Child processes inherit it.
"""

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
