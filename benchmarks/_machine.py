"""What the benchmark scripts print above their tables: the machine and the versions a number depends on.

Read without importing the packages (``importlib.metadata``), so that describing the machine never changes what an
import-time measurement sees.
"""

from __future__ import annotations

import os
import platform
from importlib import metadata

PACKAGES = ("fabriclite", "torch", "lightning-fabric", "lightning", "accelerate", "triton")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or what ``platform`` knows elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def installed_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def describe() -> list[str]:
    """Markdown lines describing this machine and the installed versions.

    Usage: ``print("\\n".join(describe()))``.
    """
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    versions = ", ".join(f"{name} {version}" for name in PACKAGES if (version := installed_version(name)))
    return [
        f"- CPU: {cpu_model()}, {usable} usable cores ({os.cpu_count()} online)",
        f"- Python {platform.python_version()} on {platform.system()} {platform.release()}",
        f"- Packages: {versions}",
    ]
