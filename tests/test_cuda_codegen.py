"""The GPU suite's compiled rows get through TorchInductor's CUDA (Triton) code generation without a GPU
(tools/cuda_codegen.py: fake tensors on "cuda", every kernel compiled by Triton for sm_90). Until this ran in CI only
a GPU run reached that code: an H200 run raised ``InductorError: KeyError: 'op24'`` in ``gpt compiled + all
kernels``, where a CPU compile (C++ code, the kernels interpreted) passed. The GPT's sizes are the smallest that
showed that error; the ViT's are the suite's smoke sizes."""

import re
import sys

import pytest
import torch
from helpers import ROOT, run_python

sys.path.insert(0, str(ROOT / "tools"))
import cuda_codegen  # noqa: E402

ROWS = ["gpt compiled", "gpt compiled + all kernels", "vit compiled + all kernels"]
UNSUPPORTED = cuda_codegen.unsupported(torch.__version__)

pytestmark = [
    pytest.mark.torch_versions,  # Inductor's code generation changes from one torch to the next
    pytest.mark.skipif(UNSUPPORTED is not None, reason=UNSUPPORTED or ""),
    pytest.mark.timeout(660),  # the first test runs the fixture's child, which may take 600 s
]


@pytest.fixture(scope="module")
def compiled_rows() -> str:
    pytest.importorskip("triton")
    result = run_python(str(ROOT / "tools" / "cuda_codegen.py"), *ROWS, timeout=600, check=False)
    return result.stdout + result.stderr


@pytest.mark.parametrize("row", ROWS)
def test_the_gpu_suites_row_compiles_for_an_h200_through_inductors_cuda_code_generation(compiled_rows, row):
    result = re.search(rf"^(OK|FAIL) {re.escape(row)}: (.*)$", compiled_rows, re.MULTILINE)
    assert result is not None, compiled_rows[-5000:]
    assert result.group(1) == "OK", compiled_rows[result.start() :][:5000]  # the error and its traceback
    kernels = int(re.search(r"(\d+) kernel configs compiled for sm_90", result.group(2)).group(1))
    assert kernels > 0, result.group(0)  # Triton compiled Inductor's kernels, not only Inductor wrote them
