"""``fabriclite.preemption``, the path the docs and users' scripts name (``from fabriclite.preemption import
PREEMPTED_EXIT_CODE``): the same module as ``fabriclite.processes.preemption``, where the process layer keeps it."""

import sys

from fabriclite.processes import preemption

sys.modules[__name__] = preemption  # one module, whichever path imported it: its state is not duplicated
