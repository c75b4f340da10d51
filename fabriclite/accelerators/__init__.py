"""Which hardware runs the work: CPU, CUDA or MPS, and which device indices of it (Lightning's paths
``accelerators.cuda`` and ``accelerators.mps`` re-export from here)."""

from __future__ import annotations

import functools

import torch

from fabriclite._versions import cpu_bf16_instructions


class Accelerator:
    """One kind of hardware. ``fabric.accelerator`` is an instance; ``devices`` lists the devices it drives.

    Usage: ``CPUAccelerator([0]).device(0)``.
    """

    name = "base"
    type = "cpu"

    def __init__(self, device_indices: list[int]) -> None:
        self.device_indices = device_indices

    @staticmethod
    def is_available() -> bool:
        return True

    def device(self, local_rank: int = 0) -> torch.device:
        """The device the process with this local rank uses."""
        return torch.device(self.type, self.device_indices[local_rank])

    def setup_device(self, device: torch.device) -> None:
        """Make ``device`` the current device of this process (CUDA needs it; others don't)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(devices={self.device_indices})"


class CPUAccelerator(Accelerator):
    name = "cpu"
    type = "cpu"

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")


class CUDAAccelerator(Accelerator):
    name = "cuda"
    type = "cuda"

    @staticmethod
    def is_available() -> bool:
        return torch.cuda.is_available()

    def setup_device(self, device: torch.device) -> None:
        torch.cuda.set_device(device)


class MPSAccelerator(Accelerator):
    name = "mps"
    type = "mps"

    @staticmethod
    def is_available() -> bool:
        return torch.backends.mps.is_available()

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("mps")


def find_usable_cuda_devices(num_devices: int = -1) -> list[int]:
    """The indices of ``num_devices`` CUDA devices this process can use now (-1: all of them), for
    ``Fabric(devices=find_usable_cuda_devices(2))``. A device another process holds in exclusive-process mode is
    passed over; fewer usable devices than asked for is an error naming the occupied ones.

    Usage: ``Fabric(accelerator="cuda", devices=find_usable_cuda_devices(2))``.
    """
    if isinstance(num_devices, bool) or not isinstance(num_devices, int) or num_devices < -1:
        raise ValueError(f"num_devices={num_devices!r} must be an int >= 0, or -1 for every usable device.")
    if num_devices == 0:
        return []
    visible = torch.cuda.device_count()  # 0 without CUDA; honours CUDA_VISIBLE_DEVICES
    if visible == 0 or num_devices > visible:
        raise ValueError(
            f"find_usable_cuda_devices({num_devices}) asks for more CUDA devices than this machine shows ({visible})."
        )
    usable, occupied = [], []
    for index in range(visible):
        try:  # an exclusive-process device held by another process refuses a context
            torch.empty(1, device=torch.device("cuda", index))
        except RuntimeError:
            occupied.append(index)
            continue
        usable.append(index)
        if len(usable) == num_devices:
            break
    if num_devices != -1 and len(usable) < num_devices:
        raise RuntimeError(
            f"find_usable_cuda_devices({num_devices}) found only {len(usable)} usable CUDA devices {usable}; "
            f"devices {occupied} are held by other processes."
        )
    return usable


@functools.cache
def cpu_has_native_bf16() -> bool:
    """Whether this machine's CPU computes bfloat16 in hardware: AVX-512 BF16 or AMX on x86 (torch's CPUID probe,
    else the flags in /proc/cpuinfo), the BF16 extension on Arm (/proc/cpuinfo). Without it torch emulates bf16 on
    the CPU, and ``precision="bf16-mixed"`` trains several times slower than ``"32-true"`` there. False also where
    neither source answers: fp32 is the choice that is never emulated. The one place fabriclite asks (the warning
    of ``Fabric(precision="bf16-mixed")`` on a CPU, the demo's default precision).

    Usage: ``precision = "bf16-mixed" if cpu_has_native_bf16() else "32-true"``.
    """
    found = cpu_bf16_instructions()
    if found is not None:
        return found
    return bool(_cpu_flags() & {"avx512_bf16", "amx_bf16", "bf16"})


def _cpu_flags() -> set[str]:
    # Linux lists them for each core: x86's "flags", Arm's "Features"; the first core's stand for all.
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


def select_accelerator(name: str, devices: int | list[int] | str) -> Accelerator:
    """Turn a parsed accelerator name and devices value into an ``Accelerator`` with concrete device indices.

    Usage: ``select_accelerator("auto", "auto")`` picks CUDA, then MPS, then the CPU.
    """
    if name == "auto":
        name = "cuda" if CUDAAccelerator.is_available() else "mps" if MPSAccelerator.is_available() else "cpu"
    elif name == "gpu":
        if CUDAAccelerator.is_available():
            name = "cuda"
        elif MPSAccelerator.is_available():
            name = "mps"
        else:
            raise RuntimeError(
                "accelerator='gpu' was requested but neither CUDA nor MPS is available. Use accelerator='cpu'."
            )

    if name == "cpu":
        count = 1 if devices == "auto" else devices
        if not isinstance(count, int) or count < 1:
            raise ValueError(
                f"devices={devices!r} is not valid with accelerator='cpu': expected a positive int (the number of processes)."
            )
        return CPUAccelerator(list(range(count)))

    if name == "mps":
        if not MPSAccelerator.is_available():
            raise RuntimeError("accelerator='mps' was requested but MPS is not available on this machine.")
        if devices not in ("auto", 1, -1, [0]):
            raise ValueError(
                f"devices={devices!r} is not valid with accelerator='mps': MPS has one device, use devices=1."
            )
        return MPSAccelerator([0])

    if not CUDAAccelerator.is_available():
        raise RuntimeError(
            f"accelerator={name!r} was requested but CUDA is not available. Use accelerator='cpu' or 'auto'."
        )
    available = torch.cuda.device_count()
    if devices in ("auto", -1):
        indices = list(range(available))
    elif isinstance(devices, int):
        indices = list(range(devices))
    else:
        indices = list(devices)
    if not indices or max(indices) >= available:
        raise ValueError(
            f"devices={devices!r} asks for CUDA devices this machine lacks: it has {available} (indices 0..{available - 1})."
        )
    return CUDAAccelerator(indices)
