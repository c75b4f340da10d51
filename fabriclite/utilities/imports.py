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


def triton_op_available() -> bool:
    """Whether ``torch.library.triton_op`` and ``wrap_triton`` exist (torch 2.6 and newer): an op registered with
    them shows torch.compile the Triton kernels inside it, which Inductor then launches from its own code."""
    return hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton")


try:
    # True while torch.compile traces the body of a ``triton_op``: a kernel launched then must go through
    # ``torch.library.wrap_triton`` to land in the graph.
    from torch._library.triton import is_wrap_triton_enabled as wrap_triton_enabled
except ImportError:  # torch < 2.6: no triton_op, so never

    def wrap_triton_enabled() -> bool:
        return False


def inductor_cache_dir() -> str:
    """The folder Inductor keeps its compiled code in: ``TORCHINDUCTOR_CACHE_DIR``, else its default under the
    temporary folder.

    Usage: ``Path(inductor_cache_dir()) / "fabriclite"``.
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return cache_dir()


def inductor_vec_isa_fingerprint() -> str | None:
    """What Inductor's check of the CPU's vector instruction sets depends on, as one string: this torch (version and
    place), the C++ compiler and its version, and the instruction sets the CPU's flags offer. None where fabriclite
    leaves the check to Inductor: off x86-64 Linux (other checks), on a torch without these modules, or where
    ``torch._inductor.config.cpp.vec_isa_ok`` (``TORCHINDUCTOR_VEC_ISA_OK``) is set.

    Usage: ``key = inductor_vec_isa_fingerprint()``.
    """
    from torch._inductor import config

    try:
        from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler
        from torch._inductor.cpu_vec_isa import supported_vec_isa_list  # noqa: F401  (what _offered_vec_isas reads)
    except ImportError:  # an older torch keeps them elsewhere: Inductor checks in each process, as it always did
        return None
    if sys.platform != "linux" or platform.machine() != "x86_64" or config.cpp.vec_isa_ok is not None:
        return None
    compiler = get_cpp_compiler()
    return repr((torch.__version__, torch.__file__, compiler, get_compiler_version_info(compiler), _offered_vec_isas()))


def inductor_vec_isa_all_pass() -> bool:
    """Run Inductor's check of the CPU's vector instruction sets (it builds a test program per set and loads each in
    a child process; its result is kept for this process) and say whether every set the CPU's flags offer passed.
    x86-64 only (see ``inductor_vec_isa_fingerprint``).

    Usage: ``inductor_vec_isa_all_pass()`` -> True on a machine whose C++ compiler and torch agree.
    """
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    offered = _offered_vec_isas()
    return bool(offered) and [str(isa) for isa in valid_vec_isa_list()] == offered


def _offered_vec_isas() -> list[str]:
    # The sets Inductor would check on x86-64, chosen by the CPU's flags as valid_vec_isa_list() does, without
    # asking a set whether it passed: each set keeps its first answer for the process (functools.cache).
    from torch._inductor.cpu_vec_isa import supported_vec_isa_list, x86_isa_checker

    flags = x86_isa_checker()
    return [str(isa) for isa in supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


def dynamo_supported() -> bool:
    """Whether ``torch.compile``'s frame evaluation (dynamo) runs on this Python and platform.

    Usage: ``if not dynamo_supported(): pytest.skip("torch.dynamo")``.
    """
    from torch._dynamo.eval_frame import is_dynamo_supported

    return is_dynamo_supported()
