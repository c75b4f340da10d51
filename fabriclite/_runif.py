"""Why a test cannot run here, for ``pytest.mark.skipif``: Lightning Fabric's ``utilities.testing._runif_reasons``
(test suites written for Lightning, such as LitGPT's, build their ``RunIf`` marker on it).

Usage::

    reasons, marker_kwargs = _runif_reasons(min_cuda_gpus=2, standalone=True)
    mark = pytest.mark.skipif(bool(reasons), reason=f"Requires: [{' + '.join(reasons)}]", **marker_kwargs)
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import torch


def _version(text: str) -> tuple[int, ...]:
    # "2.4", "2.4.1", "2.6.0a0+git": the leading release numbers only, as Lightning compares base versions
    return tuple(int(n) for n in re.findall(r"\d+", re.match(r"[\d.]*", text)[0]))


def _runif_reasons(
    *,
    min_cuda_gpus: int = 0,
    min_torch: str | None = None,
    max_torch: str | None = None,
    min_python: str | None = None,
    bf16_cuda: bool = False,
    tpu: bool = False,
    mps: bool | None = None,
    skip_windows: bool = False,
    standalone: bool = False,
    deepspeed: bool = False,
    dynamo: bool = False,
    linux_only: bool = False,
) -> tuple[list[str], dict[str, bool]]:
    """The requirements this machine does not meet, in Lightning's words, and the marker keywords Lightning's
    conftest reads (``min_cuda_gpus``, ``tpu``, ``standalone``); see the module docstring for the usage."""
    reasons: list[str] = []
    marker_kwargs: dict[str, bool] = {}
    if min_cuda_gpus:
        if torch.cuda.device_count() < min_cuda_gpus:
            reasons.append(f"GPUs>={min_cuda_gpus}")
        marker_kwargs["min_cuda_gpus"] = True
    torch_version = _version(torch.__version__)
    if min_torch and torch_version < _version(min_torch):
        reasons.append(f"torch>={min_torch}, {torch.__version__} installed")
    if max_torch and torch_version >= _version(max_torch):
        reasons.append(f"torch<{max_torch}, {torch.__version__} installed")
    if min_python and sys.version_info[:3] < _version(min_python):
        reasons.append(f"python>={min_python}")
    if bf16_cuda and not (torch.cuda.is_available() and torch.cuda.is_bf16_supported()):
        reasons.append("CUDA device bf16")
    if skip_windows and sys.platform == "win32":
        reasons.append("unimplemented on Windows")
    if tpu:
        reasons.append("TPU")  # fabriclite runs no XLA devices
        marker_kwargs["tpu"] = True
    mps_available = torch.backends.mps.is_available()
    if mps is True and not mps_available:
        reasons.append("MPS")
    elif mps is False and mps_available:
        reasons.append("not MPS")
    if standalone:
        if os.getenv("PL_RUN_STANDALONE_TESTS", "0") != "1":
            reasons.append("Standalone execution")
        marker_kwargs["standalone"] = True
    if deepspeed and importlib.util.find_spec("deepspeed") is None:
        reasons.append("Deepspeed")
    if dynamo and not _dynamo_supported():
        reasons.append("torch.dynamo")
    if linux_only and sys.platform != "linux":
        reasons.append("only linux")
    return reasons, marker_kwargs


def _dynamo_supported() -> bool:
    from fabriclite._versions import dynamo_supported

    return dynamo_supported()
