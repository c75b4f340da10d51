"""Measure what `fabriclite plan` predicts, in a real run: run SCRIPT with its ARGS in this process (one rank of a
run `fabriclite run` started), stop it after the same two optimizer steps the plan traces, and print this rank's
peak of tensor memory as torch's allocator saw it.

The measure is torch's own: the profiler's memory events (``profile_memory=True``), one for every allocation and
every free the CPU allocator reports, summed in order; their running total's maximum is the peak of the bytes
tensors held, as ``torch.cuda.max_memory_allocated`` is on a GPU. It counts from before the script starts, as the
plan does.

Usage: ``fabriclite run --accelerator cpu --devices 2 tests/scripts/measure_memory.py examples/gpt/train.py --quick``
prints ``MEASURED <rank> <peak bytes>`` on each rank.
"""

import os
import runpy
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile

STEPS = 2


class Stop(BaseException):
    pass


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    done = [0]

    def count(optimizer, args, kwargs):
        done[0] += 1
        if done[0] >= STEPS:
            raise Stop

    register_optimizer_step_post_hook(count)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        try:
            runpy.run_path(script, run_name="__main__")
        except Stop:
            pass
    events = sorted(
        (e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"), key=lambda e: e.start_ns()
    )
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    print(f"MEASURED {os.environ.get('RANK', '0')} {peak} steps {done[0]}", flush=True)


if __name__ == "__main__":
    main()
