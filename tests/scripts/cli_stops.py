"""Started by `fabriclite run --devices 2` in tests/test_cli.py, for runs that must be stopped: every rank writes its
PID to PID_DIR/<rank>, then sleeps two minutes, so only the launcher can end it in time. With MODE "fail", rank 1
exits with code 3 instead. Usage: ``fabriclite run --devices 2 cli_stops.py fail|sleep PID_DIR``."""

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # test hygiene: die with `fabriclite run` if the test kills it

from fabriclite import Fabric  # noqa: E402

mode, pid_dir = sys.argv[1], Path(sys.argv[2])
fabric = Fabric()
fabric.launch()
fabric.barrier()
(pid_dir / str(fabric.global_rank)).write_text(str(os.getpid()))
if mode == "fail" and fabric.global_rank == 1:
    raise SystemExit(3)
time.sleep(120)
print("unreachable", flush=True)
