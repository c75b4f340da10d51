"""Throughput and MFU at Lightning Fabric's import path ``lightning.fabric.utilities.throughput``: the same module as
``fabriclite.throughput``, whichever path imported it, so that what a script or test patches here
(``mock.patch("fabriclite.utilities.throughput.get_available_flops")``, as Lightning's own tests patch theirs) is
what ``ThroughputMonitor`` calls.

Usage: ``from fabriclite.utilities.throughput import ThroughputMonitor, measure_flops``.
"""

import sys

from fabriclite import throughput

sys.modules[__name__] = throughput
