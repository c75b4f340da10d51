"""Small data helpers, at Lightning Fabric's import path ``lightning.fabric.utilities.data``.

Usage: ``DataLoader(dataset, num_workers=suggested_max_num_workers(fabric.world_size))``.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["AttributeDict", "suggested_max_num_workers"]


class AttributeDict(dict):
    """A dict whose keys are also attributes: ``hparams.lr`` is ``hparams["lr"]``.

    Usage: ``hparams = AttributeDict(lr=1e-3, batch_size=32); hparams.lr = 3e-4``.
    """

    def __getattr__(self, key: str) -> Any:
        try:
            return self[key]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no key {key!r}; it has {sorted(self)}.") from None

    def __setattr__(self, key: str, value: Any) -> None:
        self[key] = value

    def __delattr__(self, key: str) -> None:
        try:
            del self[key]
        except KeyError:
            raise AttributeError(f"{type(self).__name__} has no key {key!r}.") from None

    def __repr__(self) -> str:
        if not self:
            return ""
        width = max(len(str(key)) for key in self)
        return "\n".join(
            f"{key!s:>{width}}: {value!r}" for key, value in sorted(self.items(), key=lambda kv: str(kv[0]))
        )


def suggested_max_num_workers(local_world_size: int) -> int:
    """The most DataLoader workers each of ``local_world_size`` processes on this machine should start: the CPUs
    this process may run on, shared out, less one for the process itself (at least 1).

    Usage: ``DataLoader(dataset, num_workers=suggested_max_num_workers(devices_per_node))``.
    """
    if isinstance(local_world_size, bool) or not isinstance(local_world_size, int) or local_world_size < 1:
        raise ValueError(f"local_world_size={local_world_size!r} must be an int >= 1 (the processes on this machine).")
    try:
        cpus = len(os.sched_getaffinity(0))  # honours taskset and cgroup CPU sets; os.cpu_count() does not
    except AttributeError:  # macOS, Windows
        cpus = os.cpu_count() or 1
    return max(1, cpus // local_world_size - 1)
