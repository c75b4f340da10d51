"""Throughput and MFU, at Lightning Fabric's import path ``lightning.fabric.utilities.throughput`` (the code is
``fabriclite.throughput``).

Usage: ``from fabriclite.utilities.throughput import ThroughputMonitor, measure_flops``.
"""

from fabriclite.throughput import Throughput, ThroughputMonitor, get_available_flops, measure_flops, peak_flops

__all__ = ["Throughput", "ThroughputMonitor", "get_available_flops", "measure_flops", "peak_flops"]
