"""What differs between the torch versions fabriclite supports, in one place: the lowest layer of the package
(Lightning Fabric keeps its version flags at ``lightning.fabric.utilities.imports``, and so does fabriclite: the same
module as this one).

Every private torch name fabriclite uses (``torch._...``), and every public one younger than the oldest supported
torch, is reached through this module, which knows which versions have it and does the right thing on each. The
rest of the code reads as if there were one torch. ``tests/test_architecture.py`` fails on a private torch name
used anywhere else.

Supported: torch 2.8 to 2.15 (CI runs the version-sensitive tests on 2.8, 2.11 and 2.15, the whole suite on 2.13).
Not older, because FSDP2 on CPU (gloo), the only place CI can run it, cannot be made right there: on 2.6 it fails
at its first backward (CPU streams have no ``record_event``); on 2.7 gloo's reduce-scatter sums the gradients FSDP2
asks it to average (2x at 2 ranks), its all-reduce refuses to average (hybrid sharding fails), and FSDP2 cannot yet
be told to sum and divide itself. ``import fabriclite`` with an older torch raises an ``ImportError`` saying so.

This module imports nothing of fabriclite, so every layer may import it. Usage:
``from fabriclite._versions import default_compile_backend``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import platform
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch._library.triton import is_wrap_triton_enabled
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

TORCH_FLOOR = (2, 8)  # why not older: this module's docstring


def _version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def check_torch_version(version: str = torch.__version__) -> None:
    """Raise ``ImportError`` naming the installed and the needed torch when ``version`` is below the floor.

    Usage: ``check_torch_version()`` (``import fabriclite`` runs it).
    """
    if _version_tuple(version) < TORCH_FLOOR:
        needed = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(
            f"fabriclite needs torch >= {needed}, the oldest torch it is tested with, but torch {version} is "
            f"installed. Upgrade torch: pip install 'torch>={needed}' (README.md, 'Supported torch versions')."
        )


check_torch_version()

_TORCH_VERSION = _version_tuple(torch.__version__)
_IS_WINDOWS = platform.system() == "Windows"
_IS_INTERACTIVE = hasattr(sys, "ps1") or bool(sys.flags.interactive)
# Lightning's flags, which code written for Lightning Fabric (LitGPT) imports from here.
_TORCH_GREATER_EQUAL_2_3 = _TORCH_VERSION >= (2, 3)
_TORCH_GREATER_EQUAL_2_4 = _TORCH_VERSION >= (2, 4)


def _needs(feature: str, version: str) -> RuntimeError:
    return RuntimeError(f"{feature} needs torch >= {version}; this is torch {torch.__version__}. Upgrade torch.")


# ---------------------------------------------------------------------- torch.compile
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


def compile_backend(
    backend: Any, mode: str | None, options: dict | None, dynamic: Any, name: str | None, use_aoti: bool
) -> Callable[..., Any]:
    """The backend object ``torch.compile`` builds from its arguments (torch/__init__.py's private wrappers):
    inductor, inductor ahead of time (``options={"use_aoti": True}``, torch >= 2.11) or any other backend.

    Usage: ``inner = compile_backend("inductor", "default", None, None, None, False)``.
    """
    if backend != "inductor":
        return torch._TorchCompileWrapper(backend, mode, options, dynamic)
    if use_aoti:
        if not hasattr(torch, "_TorchCompileAOTInductorWrapper"):
            raise _needs("torch.compile(options={'use_aoti': True})", "2.11")
        wrapper = torch._TorchCompileAOTInductorWrapper
    else:
        wrapper = torch._TorchCompileInductorWrapper
    if name and "name" in inspect.signature(wrapper).parameters:  # torch >= 2.13 names its compiled code
        return wrapper(mode, options, dynamic, name=name)
    return wrapper(mode, options, dynamic)


def warm_compile_workers(backend: Any = None) -> bool:
    """Start Inductor's pool of compile worker processes now, where ``backend`` (``torch.compile``'s argument, None
    for the default) is Inductor, as torch does when a backend is looked up by the name "inductor"
    (``torch._inductor.async_compile.maybe_warm_pool``). ``torch.compile(backend="inductor")`` does not: the pool
    starts at the first kernel a compile generates, and until its workers have imported torch (seconds) that
    compile's Triton kernels are compiled one by one in this process. Started when a process joins the run, the
    workers get ready while the script builds its model and data. False where nothing was started: another
    backend, one compile thread (``TORCHINDUCTOR_COMPILE_THREADS=1``), no triton, ``TORCH_WARM_POOL=0``, or a torch
    without the function.

    Usage: ``warm_compile_workers()`` in a process that will compile for a GPU.
    """
    if (backend or default_compile_backend()) != "inductor":
        return False
    try:
        from torch._inductor.async_compile import AsyncCompile, get_compile_threads, maybe_warm_pool
    except ImportError:  # moved in a newer torch: the pool starts at the first compile, as without fabriclite
        return False
    if get_compile_threads() <= 1:
        return False
    maybe_warm_pool()
    return AsyncCompile.process_pool.cache_info().currsize > 0


def current_compile_id() -> Any:
    """The id of the compile Dynamo is running now (None outside one). Usage: in a backend, ``current_compile_id()``."""
    from torch._guards import CompileContext

    return CompileContext.current_compile_id()


def maybe_mark_dynamic(tensor: torch.Tensor, dim: int) -> None:
    """Tell Dynamo that ``dim`` of ``tensor`` may change size, without failing if it does not.

    Usage: ``maybe_mark_dynamic(batch, 0)`` before calling a compiled function, outside the traced code.
    """
    torch._dynamo.maybe_mark_dynamic(tensor, dim)


def is_inductor_backend(backend: Any) -> bool:
    """Whether ``backend`` (from ``compile_backend``) is Inductor compiling just in time, as ``torch.compile``'s
    default. Usage: ``if is_inductor_backend(inner): ...``."""
    return type(backend) is torch._TorchCompileInductorWrapper


def inductor_options(options: dict[str, Any]) -> Any:
    """A context in which Inductor's settings are ``options`` (``{"cpp.vec_isa_ok": True}``), as while it compiles
    with them. Usage: ``with inductor_options(backend.config): load()``."""
    from torch._inductor import config

    return config.patch(options)


def precompile_supported() -> bool:
    """Whether this torch can compile a function ahead of time into bytes that a later process loads instead of
    compiling (``torch._dynamo.aot_compile``, experimental), with Inductor's caches on. From torch 2.11 (checked on
    2.11, 2.13, 2.14 and 2.15, not 2.12); older ones have no ``aot_compile`` and compile as before.

    Usage: ``if precompile_supported(): compiled = precompile(block.forward, (x,), {}, backend)``.
    """
    if _TORCH_VERSION < (2, 11):
        return False
    try:
        from torch._dynamo.aot_compile import AOTCompiledFunction, aot_compile_fullgraph  # noqa: F401
        from torch._dynamo.hooks import Hooks  # noqa: F401
        from torch._inductor import config
    except ImportError:  # moved in a newer torch: compile as before
        return False
    needed = ("serialize", "deserialize", "guard_check", "disable_guard_check", "source_info")
    return all(hasattr(AOTCompiledFunction, name) for name in needed) and not config.force_disable_caches


def precompile(method: Callable[..., Any], args: tuple, kwargs: dict[str, Any], backend: Any) -> Any:
    """Trace ``method`` (a module's bound ``forward``) whole on ``args`` and compile it with ``backend``: a function
    to call as ``compiled(module, *args)`` once ``precompiled_guards_pass`` says the inputs are those it was compiled
    for. Raises where the method has a graph break or the compiled code cannot be saved.

    Usage: ``compiled = precompile(block.forward, (x,), {}, backend)``.
    """
    from torch._dynamo.aot_compile import aot_compile_fullgraph
    from torch._dynamo.hooks import Hooks

    with warnings.catch_warnings():
        # Saving the guards reads ``.grad`` of every input, a non-leaf activation's too; torch warns about that.
        warnings.filterwarnings("ignore", message="The .grad attribute of a Tensor that is not a leaf")
        compiled = aot_compile_fullgraph(method, (tuple(args), dict(kwargs)), hooks=Hooks(), backend=backend)
    compiled.disable_guard_check()  # the caller checks once, before choosing it
    return compiled


def precompiled_to_bytes(compiled: Any) -> bytes:
    """What ``precompile`` made, as bytes for ``precompiled_from_bytes``. Usage: ``path.write_bytes(...)``."""
    return type(compiled).serialize(compiled).serialized_data


def precompiled_from_bytes(data: bytes, module_globals: dict[str, Any]) -> Any:
    """Load what ``precompiled_to_bytes`` wrote; ``module_globals``: those of the traced method's module.

    Usage: ``compiled = precompiled_from_bytes(path.read_bytes(), type(block).forward.__globals__)``.
    """
    from torch._dynamo.aot_compile import AOTCompiledFunction

    compiled = AOTCompiledFunction.deserialize(data, f_globals=module_globals)
    compiled.disable_guard_check()
    return compiled


def precompiled_sources(compiled: Any) -> list[tuple[str, str]]:
    """(module name, the module's whole source) of every module whose code ``compiled`` was traced from.

    Usage: ``all(inspect.getsource(sys.modules[name]) == source for name, source in precompiled_sources(c))``.
    """
    return [(source.module, source.content) for source in compiled.source_info().inlined_sources]


def precompiled_guards_pass(compiled: Any, args: tuple, kwargs: dict[str, Any]) -> bool:
    """Whether ``compiled`` was compiled for inputs like these (``args`` starting with the module): Dynamo's guards
    on shapes, dtypes, grad mode, the module's attributes. Usage: ``precompiled_guards_pass(c, (block, x), {})``."""
    return bool(compiled.guard_check(*args, **kwargs))


def module_call_hooks(module: torch.nn.Module) -> bool:
    """Whether calling ``module`` runs hooks around its ``forward`` (its own forward and backward hooks, or the
    global ones every module runs). Usage: ``if not module_call_hooks(block): compile(block.forward)``."""
    from torch.nn.modules import module as nn_module

    own = (module._forward_pre_hooks, module._forward_hooks, module._backward_pre_hooks, module._backward_hooks)
    shared = (nn_module._global_forward_pre_hooks, nn_module._global_forward_hooks)
    shared += (nn_module._global_backward_pre_hooks, nn_module._global_backward_hooks)
    return any(own) or any(shared)


def reset_compiler() -> None:
    """Drop Dynamo's compiled code and caches, if Dynamo was ever imported. Usage: ``reset_compiler()``."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is not None:
        dynamo.reset()


def addmm_out_dtype_supported() -> bool:
    """Whether ``torch.addmm`` takes ``out_dtype`` (adding a bf16/fp16 product into an fp32 tensor in one GEMM on
    CUDA): not every supported torch has it, so its presence is checked.

    Usage: ``if addmm_out_dtype_supported(): torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)``.
    """
    return hasattr(torch.ops.aten.addmm, "dtype_out")


def traced_triton_launch(tensor: torch.Tensor) -> bool:
    """True when a Triton kernel launched on ``tensor`` must go through ``torch.library.wrap_triton`` to land in a
    graph: torch.compile is tracing the body of a ``torch.library.triton_op`` (the tensor is a fake or functional one
    and wrapping is on). False for a real tensor, whose kernel is launched directly: torch leaves wrapping on outside
    any trace too, and a wrapped launch on a real tensor goes through a higher-order op's dispatch (and, on torch
    2.8 to 2.12, fails under Triton's interpreter).

    Usage: ``if traced_triton_launch(x): torch.library.wrap_triton(kernel)[grid](x, ...)``.
    """
    return isinstance(tensor, (FakeTensor, FunctionalTensor)) and is_wrap_triton_enabled()


def inductor_cache_dir() -> str:
    """The folder Inductor keeps its compiled code in: ``TORCHINDUCTOR_CACHE_DIR``, else its default under the
    temporary folder.

    Usage: ``Path(inductor_cache_dir()) / "fabriclite-compile"``.
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
    x86-64 only (see ``inductor_vec_isa_fingerprint``). Usage: ``inductor_vec_isa_all_pass()`` -> True on a machine
    whose C++ compiler and torch agree."""
    from torch._inductor.cpu_vec_isa import valid_vec_isa_list

    offered = _offered_vec_isas()
    return bool(offered) and [str(isa) for isa in valid_vec_isa_list()] == offered


def _offered_vec_isas() -> list[str]:
    # The sets Inductor would check on x86-64, chosen by the CPU's flags as valid_vec_isa_list() does, without
    # asking a set whether it passed: each set keeps its first answer for the process (functools.cache).
    from torch._inductor.cpu_vec_isa import supported_vec_isa_list, x86_isa_checker

    flags = x86_isa_checker()
    return [str(isa) for isa in supported_vec_isa_list if all(flag in flags for flag in str(isa).split())]


def cpu_bf16_instructions() -> bool | None:
    """Whether torch's CPUID probe finds AVX-512 BF16 or AMX (whose CPUs all have AMX-BF16) on this x86 CPU; None off
    x86 and on a torch without these private probes. Usage: ``cpu_bf16_instructions()`` -> False on AVX2 only."""
    probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if platform.machine().lower() not in ("x86_64", "amd64") or not all(map(callable, probes)):
        return None
    return any(probe() for probe in probes)


def dynamo_supported() -> bool:
    """Whether ``torch.compile``'s frame evaluation (dynamo) runs on this Python and platform.
    Usage: ``if not dynamo_supported(): pytest.skip("torch.dynamo")``."""
    from torch._dynamo.eval_frame import is_dynamo_supported

    return is_dynamo_supported()


# ---------------------------------------------------------------------- building and sharding models
def device_constructors() -> set[Callable[..., Any]]:
    """The torch functions that create a tensor and take ``device=`` (what ``with torch.device(...)`` redirects).

    Usage: ``if func in device_constructors(): kwargs["device"] = device``.
    """
    from torch.utils._device import _device_constructors

    return _device_constructors()


def checkpoint_activations(module: torch.nn.Module, **options: Any) -> None:
    """Recompute ``module``'s activations in backward instead of keeping them (the composable ``checkpoint``, which
    FSDP2 composes with; ``options`` are its own). Usage: ``checkpoint_activations(block, preserve_rng_state=False)``."""
    from torch.distributed._composable import checkpoint

    checkpoint(module, **options)


def fsdp1_policy_targets(policy: Any, root: torch.nn.Module) -> dict[torch.nn.Module, dict[str, Any]]:
    """The modules under ``root`` an FSDP1 policy object (``ModuleWrapPolicy``, ``CustomPolicy``) picks, each with
    the keyword arguments it gives it, as FSDP1 runs it. Usage: ``fsdp1_policy_targets(CustomPolicy(fn), model)``."""
    return policy._run_policy(root, set(), {})


def average_gradients_on_gloo(module: torch.nn.Module) -> None:
    """Make every FSDP2 unit of ``module`` whose mesh runs over gloo average its gradients right.

    FSDP2 reduces fp32 and bf16 gradients with an averaging reduce-scatter (``ReduceOp.AVG``). gloo's reduce-scatter
    ignores the operation and sums on torch 2.6, 2.7 and 2.8 (gradients exactly world size times one process's;
    2.11 and newer average). Asking FSDP2 for sum reductions (``set_force_sum_reduction_for_comms``, torch >= 2.8)
    makes it divide the gradients itself, which is right on every version, also for hybrid sharding's all-reduce;
    on NCCL nothing changes. Usage: ``average_gradients_on_gloo(model)`` after ``fully_shard``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    for unit in module.modules():
        if not isinstance(unit, FSDPModule):
            continue
        param = next(unit.parameters(), None)
        if not isinstance(param, DTensor):
            continue
        mesh = param.device_mesh
        if any("gloo" in dist.get_backend(mesh.get_group(dim)) for dim in range(mesh.ndim)):
            unit.set_force_sum_reduction_for_comms(True)


# ---------------------------------------------------------------------- checkpoints
def inner_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding the memory of a wrapper tensor subclass (torchao's float8 weights wrap their fp32
    weight), or ``tensor`` itself: a wrapper has no storage of its own.
    Usage: ``inner_tensor(dtensor.to_local()).untyped_storage()``."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    while is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        tensor = getattr(tensor, names[0])
    return tensor


def dcp_metadata_path(reader: Any, rank: int | None) -> Path:
    """The ``.metadata`` file a ``torch.distributed.checkpoint`` ``FileSystemReader`` reads (one per rank with
    ``rank``, where torch supports that).

    Usage: ``path = dcp_metadata_path(reader, kwargs.get("rank"))``.
    """
    if hasattr(reader, "_get_metadata_path"):  # newer torch; 2.8 has no per-rank metadata
        return Path(reader._get_metadata_path(rank))
    return Path(reader.path) / ".metadata"


# ---------------------------------------------------------------------- process groups
def process_groups() -> dict[Any, Any]:
    """The process groups of this process that are alive (the default one included), keyed by group; torch keeps
    this table privately. Usage: ``if group in process_groups(): dist.destroy_process_group(group)``."""
    import torch.distributed.distributed_c10d as c10d

    return c10d._pg_map


def collective_count(group: Any) -> int:
    """The collectives this process issued on ``group``, by torch's private count. Usage: ``collective_count(g)``."""
    return group._get_sequence_number_for_group()


# ---------------------------------------------------------------------- optional packages
class _Requirement:
    """Whether a package is installed, as Lightning's ``RequirementCache``: true or false, and its ``str`` says how
    to install it when it is missing."""

    def __init__(self, package: str, install: str | None = None) -> None:
        self.package = package
        self.install = install or package  # what pip installs, where its name differs from the import's

    def __bool__(self) -> bool:
        return importlib.util.find_spec(self.package) is not None

    def __str__(self) -> str:
        if self:
            return f"Requirement {self.package!r} met ({importlib.metadata.version(self.package)})"
        return f"Requirement {self.package!r} not met. HINT: Try running `pip install -U {self.install!r}`"


# ---------------------------------------------------------------------- torchao (the fp8 precision)
# The torchao releases whose float8 training goes with each torch, from torchao's own compatibility table (issue
# pytorch/ao#2919, removed in torchao 0.17): 0.13 and 0.14.0 were built against torch 2.8, 0.14.1 and 0.15 against
# 2.9, 0.16 against 2.10. From 0.17 on torchao builds on torch's stable ABI and needs torch >= 2.11. Checked here:
# torchao 0.18.0 on torch 2.13 and 0.17.0 on torch 2.11 (CPU, emulated: tests/plugins/test_fp8.py passes).
# (lowest, first too new) by torch (major, minor); None: no upper end.
TORCHAO_FOR_TORCH: dict[tuple[int, int], tuple[str, str | None]] = {
    (2, 8): ("0.13.0", "0.14.1"),
    (2, 9): ("0.14.1", "0.16.0"),
    (2, 10): ("0.16.0", "0.17.0"),
    (2, 11): ("0.17.0", None),
}


def torchao_requirement(torch_version: str = torch.__version__) -> str:
    """The pip requirement of the torchao that matches ``torch_version``.

    Usage: ``torchao_requirement("2.13.0") == "torchao>=0.17.0"``.
    """
    lowest, too_new = _torchao_range(torch_version)
    return f"torchao>={lowest}" + (f",<{too_new}" if too_new else "")


def _torchao_range(torch_version: str) -> tuple[str, str | None]:
    # A torch newer than the table's last row takes that row (torchao's stable ABI); the floor's is the oldest row.
    key = min(max(_version_tuple(torch_version), min(TORCHAO_FOR_TORCH)), max(TORCHAO_FOR_TORCH))
    return TORCHAO_FOR_TORCH[key]


def _release_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("+")[0].split(".")[:3] if part.isdigit())


def torchao_float8(torchao_version: str | None = None, torch_version: str = torch.__version__) -> Any:
    """``torchao.float8``, once torchao is known to be installed in a release that matches this torch; else an
    ``ImportError`` (``ModuleNotFoundError`` when torchao is missing) naming both versions and the pip command.
    ``torchao_version`` stands in for the installed one (tests).

    Usage: ``float8 = torchao_float8(); float8.convert_to_float8_training(model, config=...)``.
    """
    needed = torchao_requirement(torch_version)
    if torchao_version is None:
        try:
            torchao_version = importlib.metadata.version("torchao")
        except importlib.metadata.PackageNotFoundError:
            raise ModuleNotFoundError(
                f"No module named 'torchao': precision='fp8-mixed' (Float8Precision) trains with torchao's float8 "
                f"layers. For torch {torch_version}: pip install '{needed}' (or pip install 'fabriclite[fp8]')."
            ) from None
    lowest, too_new = _torchao_range(torch_version)
    release = _release_tuple(torchao_version)
    if release < _release_tuple(lowest) or (too_new is not None and release >= _release_tuple(too_new)):
        raise ImportError(
            f"precision='fp8-mixed' needs the torchao built for torch {torch_version}, but torchao "
            f"{torchao_version} is installed: pip install '{needed}'."
        )
    import torchao.float8

    return torchao.float8
