"""What differs between the torch versions fabriclite supports, in one place (Lightning Fabric keeps its version
flags at this path too: ``lightning.fabric.utilities.imports``).

Every private torch name fabriclite uses, and every public one younger than the oldest supported torch, is reached
through this module, which knows which versions have it and does the right thing on each. The rest of the code reads
as if there were one torch.

Usage: ``from fabriclite.utilities.imports import default_compile_backend``.
"""

from __future__ import annotations

import platform
import sys

import torch


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


_TORCH_VERSION = _version_tuple(torch.__version__)
_IS_WINDOWS = platform.system() == "Windows"
_IS_INTERACTIVE = hasattr(sys, "ps1") or bool(sys.flags.interactive)
_TORCH_GREATER_EQUAL_2_3 = _TORCH_VERSION >= (2, 3)
_TORCH_GREATER_EQUAL_2_4 = _TORCH_VERSION >= (2, 4)


def default_compile_backend() -> str:
    """The backend ``torch.compile`` uses when none is given: ``get_default_backend()`` where torch has it (2.13
    and newer, where it can be configured), else ``"inductor"``, which every older torch uses.

    Usage: ``backend = options.get("backend") or default_compile_backend()``.
    """
    try:
        from torch._dynamo.backends.registry import get_default_backend
    except ImportError:  # torch < 2.13
        return "inductor"
    return get_default_backend()


def dynamo_supported() -> bool:
    """Whether ``torch.compile``'s frame evaluation (dynamo) runs on this Python and platform.

    Usage: ``if not dynamo_supported(): pytest.skip("torch.dynamo")``.
    """
    from torch._dynamo.eval_frame import is_dynamo_supported

    return is_dynamo_supported()
