"""The launchers through their one interface, ``launch(function, *args, **kwargs)``, on 2 real processes; prints
"PASS <rank> <name>" per check. Usage: ``python launcher_checks.py subprocess|spawn``.

No Fabric and no strategy here: each launcher is used as the strategies use it.
"""

import os
import sys

from check_report import report
from fabriclite.processes.launcher import InProcessLauncher, MultiprocessingLauncher, SubprocessLauncher
from fabriclite.plugins.environments import detect_environment

LAYOUT = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def work(tag, scale=1):
    """Runs in every process the launcher is responsible for, once the process exists."""
    env = detect_environment()
    rank = env.global_rank
    report(rank, "the rank is in the environment", env.world_size == 2 and all(name in os.environ for name in LAYOUT))
    report(rank, "the arguments arrive", (tag, scale) == ("job", 3))
    return (rank, os.getpid())


if __name__ == "__main__":
    method = sys.argv[1]
    if method == "spawn":
        launcher = MultiprocessingLauncher(2)
        result = launcher.launch(work, "job", scale=3)
        # Only rank 0's result comes back, and the work ran in new processes, not in this one.
        report(0, "rank 0's result comes back", result[0] == 0 and result[1] != os.getpid())
        report(0, "this process stays outside the run", "RANK" not in os.environ)
    else:
        # The script runs again in the second process, which finds its rank in the environment: processes that
        # exist already are run in place, as a strategy decides.
        launcher = InProcessLauncher() if detect_environment() else SubprocessLauncher(2)
        rank, pid = launcher.launch(work, "job", scale=3)
        report(rank, "the function runs in this process", pid == os.getpid())
        if isinstance(launcher, SubprocessLauncher):
            try:
                launcher.launch(work, "job", scale=3)
                twice = False
            except RuntimeError as error:
                twice = "already called" in str(error)
            report(rank, "launching twice is refused", twice)
    os.write(1, b"DONE\n")
