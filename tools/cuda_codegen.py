"""Compile a few training steps of the GPU suite's models through TorchInductor's CUDA (Triton) code generation on a
machine without a GPU, so that CI reaches what only a GPU run reached before (an H200 run raised
``InductorError: KeyError: 'op24'`` in the row ``gpt compiled + all kernels``; fixed in kernels/_norm.py).

The model, its batches, and its training step are benchmarks/in_model.py's (``set_up``: ``Fabric(precision=
"bf16-mixed", compile=True)``, the norms swapped, AdamW), built under a ``FakeTensorMode`` on "cuda": tensors with
shapes, strides and dtypes but no memory. Dynamo, AOTAutograd (forward, backward, partition) and Inductor (lowering,
scheduling, fusion, Triton source, wrapper code) run unmodified, and each kernel config is compiled by Triton for an
sm_90 GPU (Triton's own ptxas). What needs a GPU is mocked: every mock below says what it stands in for. Loading and
launching kernels do nothing, so a step runs to its end without computing a value: numerics, timing and autotuning
stay with the GPU suite.

Prints one line per row, ``OK <row> ...`` or ``FAIL <row>: <the error's first line>`` followed by its traceback, and
exits 1 if a row failed. A row is a compiled GPU suite row, "<model> <variant>". It runs the checkout it
lives in (that checkout's fabriclite, kernels/, benchmarks/ and examples/), whatever fabriclite is installed.

Works with CUDA builds of torch (the native mocks are C, built with gcc) and CPU-only builds (a C++ mock built with
g++ against that torch's headers). The script builds them into a fresh temporary folder, which also holds the
Inductor and Triton caches (empty, as on a fresh GPU machine), runs itself again in a child process with them
preloaded, and removes the folder when the child ends.

Usage:
  python tools/cuda_codegen.py                                   # every compiled row of both models, small sizes
  python tools/cuda_codegen.py "gpt compiled + all kernels" --sizes full   # the GPU suite's sizes
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MOCKS = Path(__file__).resolve().with_name("cuda_codegen_mocks")  # the native mocks' C and C++ sources
CHILD_VARIABLE = "FABRICLITE_CUDA_CODEGEN_CHILD"  # set in the child process, which has the native mocks


# Torch's AOTAutograd takes FakeTensors of another FakeTensorMode as inputs (torch.compile inside a FakeTensorMode)
# since 2.11 (pytorch#170773); before, it asserts that the modes match.
OLDEST_TORCH = (2, 11)


def unsupported(torch_version: str) -> str | None:
    """Why this torch (its ``__version__``) cannot run this script, or None when it can."""
    if tuple(int(part) for part in re.findall(r"\d+", torch_version)[:2]) < OLDEST_TORCH:
        oldest = ".".join(map(str, OLDEST_TORCH))
        return f"torch {torch_version} cannot compile inside a FakeTensorMode (AOTAutograd asserts one mode); torch {oldest} and later can"
    return None


# ---------------------------------------------------------------------------------------------- native mocks
def _torch_folder() -> Path:
    """Where torch is installed, found without importing it (the parent process must not load CUDA)."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("torch is not installed in this Python")
    return Path(spec.submodule_search_locations[0])


def _build_native_mocks(folder: Path) -> dict[str, str]:
    """Build the native mocks this torch needs into ``folder``; the environment variables that preload them."""
    torch_folder = _torch_folder()
    if (torch_folder / "lib" / "libtorch_cuda.so").exists():
        # A CUDA build: libcudart's answers (preloaded) and a libcuda.so.1 for torch to dlopen (found on the path).
        runtime = folder / "libfake_cudart.so"
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", str(MOCKS / "fake_cudart.c"), "-o", str(runtime)], check=True)
        subprocess.run(["gcc", "-shared", "-fPIC", "-O1", str(MOCKS / "fake_libcuda.c"), "-o", str(folder / "libcuda.so.1")], check=True)  # fmt: skip
        return {"LD_PRELOAD": str(runtime), "LD_LIBRARY_PATH": str(folder)}
    # A CPU-only build: a "cuda" device guard and CUDA hooks, against this torch's headers and libraries (1-2 s).
    library = folder / "libfake_cuda_hooks.so"
    include, lib = torch_folder / "include", torch_folder / "lib"
    command = ["g++", "-shared", "-fPIC", "-O1", "-std=c++20", f"-isystem{include}",
               f"-isystem{include / 'torch' / 'csrc' / 'api' / 'include'}", str(MOCKS / "fake_cuda_hooks.cpp"),
               f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-o", str(library)]  # fmt: skip
    subprocess.run(command, check=True)
    return {"LD_PRELOAD": str(library)}


def _run_with_native_mocks() -> int:
    """Run this script again in a child process with the native mocks preloaded (the dynamic loader reads
    LD_PRELOAD when a process starts), and remove their temporary folder when it ends, however it ends."""
    with tempfile.TemporaryDirectory(prefix="cuda-codegen-") as name:
        folder = Path(name)
        env = dict(os.environ)
        for variable, value in _build_native_mocks(folder).items():
            env[variable] = os.pathsep.join(filter(None, [value, env.get(variable)]))
        env[CHILD_VARIABLE] = "1"
        env["TORCHINDUCTOR_CACHE_DIR"] = str(folder / "inductor")
        env["TRITON_CACHE_DIR"] = str(folder / "triton")
        env["TRITON_INTERPRET"] = "0"  # compile the kernels (the test suite's conftest asks for the interpreter)
        return subprocess.run([sys.executable, *sys.argv], env=env).returncode


# ---------------------------------------------------------------------------------------------- Python mocks
KERNELS_COMPILED = [0]  # kernel configs compiled by Triton for sm_90, for the result lines

# The device Inductor and Triton target: an H200 (sm_90), with the figures torch.cuda.get_device_properties gives.
H200 = dict(
    name="NVIDIA H200",
    major=9,
    minor=0,
    multi_processor_count=132,
    total_memory=143771 * 2**20,
    regs_per_multiprocessor=65536,
    max_threads_per_multi_processor=2048,
    max_threads_per_block=1024,
    warp_size=32,
    L2_cache_size=60 * 2**20,
    shared_memory_per_block=48 * 1024,
    shared_memory_per_block_optin=227 * 1024,
    shared_memory_per_multiprocessor=228 * 1024,
    is_integrated=False,
    is_multi_gpu_board=False,
    gcnArchName="NVIDIA H200",
    uuid="GPU-00000000-0000-0000-0000-000000000000",
    clock_rate=1980000,
    memory_clock_rate=3201000,
    memory_bus_width=6144,
    pci_bus_id=0,
    pci_device_id=0,
    pci_domain_id=0,
)


def install_mocks() -> None:
    """Patch torch, Triton and Inductor in this process so that FakeTensors on "cuda" compile as on an H200. Each
    patch is a MOCK of something that needs a GPU, unless it says it is part of the harness."""
    import types

    import torch

    _mock_cuda_queries(torch, types.SimpleNamespace(**H200))
    _mock_triton_driver()
    _mock_kernel_loading_and_launching()
    _mock_device_computation(torch)

    # Harness: compile the kernels in this process, where these mocks are (Inductor's workers would lack them).
    from torch._inductor import config

    config.compile_threads = 1

    # Harness: nn.Module.to("cuda") of a model whose tensors are all fake "cuda" ones (Fabric's move) returns it as
    # it is, as on a GPU; nn.Module would swap each parameter for a copy, which fails on a fake one's weak references.
    from torch._subclasses.fake_tensor import FakeTensor

    module_to = torch.nn.Module.to

    def to(self, *args, **kwargs):
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = [*self.parameters(), *self.buffers()]
        if dtype is None and device is not None and torch.device(device).type == "cuda":
            if all(isinstance(t, FakeTensor) and t.device.type == "cuda" for t in tensors):
                return self
        return module_to(self, *args, **kwargs)

    torch.nn.Module.to = to

    # Harness: trunc_normal_ (the ViT's initialisation) leaves the tensor as it is: newer torch's asks whether a
    # value is out of range, and a fake tensor has no values.
    torch.nn.init.trunc_normal_ = lambda tensor, *args, **kwargs: tensor


def _mock_cuda_queries(torch, properties) -> None:
    """MOCK of the CUDA runtime's answers to Python (the C mocks answer torch's C++; a CPU-only build has no
    ``torch._C._cuda_*`` functions at all): one H200 as device 0, whose random number generator is never used."""
    cuda = torch.cuda

    class DeviceGuard:  # torch.cuda._DeviceGuard and torch.cuda.device, which Inductor's wrapper code enters
        def __init__(self, index) -> None:
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> bool:
            return False

    rng_state = torch.zeros(16, dtype=torch.uint8)  # Dynamo saves and restores the CUDA RNG state around a trace
    answers = {
        "is_available": lambda: True,
        "_lazy_init": lambda: None,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "get_device_properties": lambda device=None: properties,
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "get_rng_state": lambda device="cuda": rng_state.clone(),
        "set_rng_state": lambda state, device="cuda": None,
        "_DeviceGuard": DeviceGuard,
        "device": DeviceGuard,
    }
    for name, answer in answers.items():
        setattr(cuda, name, answer)
        if hasattr(cuda.random, name):  # torch.manual_seed and Dynamo call these through torch.cuda.random
            setattr(cuda.random, name, answer)
    torch._C._cuda_getCurrentRawStream = lambda device=None: 0  # get_raw_stream in Inductor's wrapper code

    # The wrapper code's allocation helpers are C++ that allocates CUDA memory past the dispatcher, and so past
    # FakeTensorMode: the same calls through the dispatcher, which make fake tensors.
    guards = torch._C._dynamo.guards
    guards._empty_strided_cuda = lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype, device="cuda")  # fmt: skip
    guards._reinterpret_tensor = lambda tensor, size, stride, offset=0: torch.as_strided(
        tensor, size, stride, tensor.storage_offset() + offset
    )

    # FakeTensorMode makes one real CUDA tensor to initialise the device's context for the autograd engine.
    from torch._subclasses import fake_tensor

    fake_tensor.init_gpu_context = lambda device: None

    # Inductor's pattern set-up, under a FakeTensorMode of its own, makes constants with torch.tensor(number,
    # device="cuda"), which copies real memory to the device in C++, past the fake mode: a factory makes them fake.
    tensor = torch.tensor

    def tensor_on_cuda(data, *args, device=None, dtype=None, **kwargs):
        if device is not None and torch.device(device).type == "cuda" and isinstance(data, (int, float, bool)):
            return torch.full((), data, dtype=dtype or tensor(data).dtype, device=device)
        return tensor(data, *args, device=device, dtype=dtype, **kwargs)

    torch.tensor = tensor_on_cuda


def _mock_triton_driver() -> None:
    """MOCK of Triton's CUDA driver, whose utilities are C built against libcuda: it reports an sm_90 target and the
    H200's limits; loading a compiled kernel and launching one do nothing."""
    import triton
    import triton.backends
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver

    class Utils:
        def get_device_properties(self, device) -> dict:
            return {
                "max_shared_mem": H200["shared_memory_per_block_optin"],
                "multiprocessor_count": H200["multi_processor_count"],
                "max_num_regs": H200["regs_per_multiprocessor"],
                "warpSize": H200["warp_size"],
                "sm_clock_rate": H200["clock_rate"],
                "mem_clock_rate": H200["memory_clock_rate"],
                "mem_bus_width": H200["memory_bus_width"],
                "max_threads_per_block": H200["max_threads_per_block"],
            }

        def load_binary(self, *args) -> tuple:  # (module, function, registers, spills, max threads)
            return 1, 1, 0, 0, 1024

    class Launcher:
        def __init__(self, source, metadata) -> None:
            pass

        def __call__(self, *args, **kwargs) -> None:
            pass

    class FakeCudaDriver(CudaDriver):
        def __init__(self) -> None:  # not CudaDriver's, which builds its utilities against libcuda
            self.utils = Utils()
            self.launcher_cls = Launcher
            self.get_device_capability = lambda device=None: (9, 0)
            self.get_current_stream = lambda device=None: 0
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", 90, 32)

        @staticmethod
        def is_active() -> bool:
            return True

    nvidia = triton.backends.backends["nvidia"]
    triton.backends.backends["nvidia"] = dataclasses.replace(nvidia, driver=FakeCudaDriver)
    triton.runtime.driver.set_active(FakeCudaDriver())


def _mock_kernel_loading_and_launching() -> None:
    """MOCK of loading Inductor's compiled kernels into the CUDA context and launching them (and of benchmarking a
    kernel's configs, which launches them). Compiling each config with Triton still happens, and is counted."""
    from torch._inductor.runtime.triton_heuristics import CachingAutotuner

    precompile_config = CachingAutotuner._precompile_config

    def count_compiled(self, cfg):
        result = precompile_config(self, cfg)
        KERNELS_COMPILED[0] += 1
        return result

    def make_launchers(self) -> None:
        self.launchers = [None] * len(self.compile_results)

    CachingAutotuner._precompile_config = count_compiled
    CachingAutotuner._make_launchers = make_launchers
    CachingAutotuner.run = lambda self, *args, **kwargs: None


def _mock_device_computation(torch) -> None:
    """MOCK of what torch and Inductor compute or decide on the GPU while they compile."""
    # Constant folding computes the graph's constants on its device: compute them on the CPU (the same values).
    from torch._inductor.constant_folding import ConstantFolder
    from torch.utils._python_dispatch import TorchDispatchMode

    class CudaToCpu(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if kwargs.get("device") is not None and (
                torch.device(kwargs["device"]).type == "cuda" or func is torch.ops.aten._to_copy.default
            ):
                kwargs["device"] = torch.device("cpu")
            return func(*args, **kwargs)

    fold = ConstantFolder.run

    def fold_on_cpu(self, *args, **kwargs):
        with CudaToCpu():
            return fold(self, *args, **kwargs)

    ConstantFolder.run = fold_on_cpu

    # Scaled dot-product attention's backend is chosen from the GPU's properties, and a CPU-only build cannot
    # choose a CUDA one at all: call flash attention's operator for "cuda" tensors, as an H200 can (its meta
    # function gives the shapes). Where a GPU would choose another backend (torch 2.11 picks cuDNN's on an H200),
    # the graph around attention differs a little.
    import torch.nn.functional as F

    attention = F.scaled_dot_product_attention

    def flash_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if q.device.type != "cuda" or attn_mask is not None or dropout_p or enable_gqa:
            return attention(q, k, v, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[0]

    F.scaled_dot_product_attention = flash_attention

    # A convolution's backend (hence its output's memory format) is chosen from the GPU's properties too: cuDNN's,
    # as on an H200 (the ViT's patch embedding).
    torch._C._select_conv_backend = lambda *args, **kwargs: torch._C._ConvBackend.Cudnn


# ---------------------------------------------------------------------------------------------- the rows
def _use_this_checkout() -> None:
    """Import fabriclite, benchmarks/ and examples/ from this checkout, whichever fabriclite is installed. The
    top-level kernels/ is fabriclite.kernels (pyproject's package-dir): an editable install of another checkout
    would map it there, so a finder ahead of the others maps it here."""
    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
    kernels = ROOT / "kernels"

    class ThisCheckoutsKernels:
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name != "fabriclite.kernels":
                return None
            return importlib.util.spec_from_file_location(
                name, kernels / "__init__.py", submodule_search_locations=[str(kernels)]
            )

    sys.meta_path.insert(0, ThisCheckoutsKernels)


def rows() -> list[str]:
    """The GPU suite's compiled rows, "<model> <variant>". (Its eager rows compile nothing: on fake tensors
    fabriclite's kernels run their fake implementations.)"""
    from in_model import MODEL_KERNELS, variants

    return [f"{model} {v.name}" for model in MODEL_KERNELS for v in variants(model) if v.compiled]


def run_row(row: str, sizes: str, steps: int) -> bool:
    """Set the row's model up as the GPU suite does, on fake "cuda", and run ``steps`` training steps; print the
    result line (and the traceback on failure). Returns whether it passed."""
    import torch
    from in_model import set_up, variants
    from torch._subclasses.fake_tensor import FakeTensorMode

    model, variant_name = row.split(" ", 1)
    variant = next(v for v in variants(model) if v.name == variant_name)
    compiled_before, started = KERNELS_COMPILED[0], time.perf_counter()
    try:
        with FakeTensorMode():
            runner = set_up(model, variant, sizes, torch.device("cuda", 0))
            for _ in range(steps):
                runner.step(*next(runner.batches))
    except Exception as error:  # noqa: BLE001 - a failing row is reported, and the next one runs
        if type(error) is torch._dynamo.exc.BackendCompilerFailed:  # its first line names the backend only
            error = error.inner_exception
        first_line = (str(error).strip().splitlines() or [""])[0]
        print(f"FAIL {row}: {type(error).__name__}: {first_line}", flush=True)
        traceback.print_exc(file=sys.stdout)
        return False
    finally:
        torch._dynamo.reset()
    kernels = KERNELS_COMPILED[0] - compiled_before
    seconds = time.perf_counter() - started
    print(f"OK {row}: {steps} steps in {seconds:.1f} s, {kernels} kernel configs compiled for sm_90", flush=True)
    return True


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("rows", nargs="*", metavar="ROW", help='a compiled GPU suite row, e.g. "gpt compiled + all kernels"; '
                        "default: all four")  # fmt: skip
    parser.add_argument("--sizes", choices=("small", "full"), default="small",
                        help="small: a 2-layer GPT of width 128 on 2048-token windows and the smoke run's ViT; "
                        "full: the GPU suite's")  # fmt: skip
    parser.add_argument("--steps", type=int, default=2, help="training steps per row (default 2)")
    args = parser.parse_args()
    reason = unsupported(importlib.metadata.version("torch"))  # without importing torch (seconds)
    if reason:
        parser.exit(2, f"{reason}: install a newer torch to run it.\n")
    if CHILD_VARIABLE not in os.environ:
        return _run_with_native_mocks()
    _use_this_checkout()
    unknown = sorted(set(args.rows) - set(rows()))
    if unknown:
        parser.error(f"unknown rows {unknown}; the rows are {rows()}")
    install_mocks()
    import torch
    import triton

    print(f"torch {torch.__version__}, triton {triton.__version__}, {args.sizes} sizes, this checkout: {ROOT}")
    passed = [run_row(row, args.sizes, args.steps) for row in args.rows or rows()]
    sys.stdout.flush()
    # Without a normal interpreter exit: the autograd engine's "cuda" device thread would abort it.
    os._exit(0 if all(passed) else 1)


if __name__ == "__main__":
    sys.exit(main())
