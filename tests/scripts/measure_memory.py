"""Measure what `fabriclite plan` predicts, in a real run: run SCRIPT with its ARGS in this process (one rank of a
run `fabriclite run` started), stop it after the same two optimizer steps the plan traces, and print this rank's
peak of tensor memory as torch's allocator saw it, and the peak of the tensors alive.

The measure is torch's own: the profiler's memory events (``profile_memory=True``), one for every allocation and
every free the CPU allocator reports, summed in order; their running total's maximum is the peak of the bytes
tensors held, as ``torch.cuda.max_memory_allocated`` is on a GPU. It counts from before the script starts, as the
plan does. It also counts more than tensors: scratch that kernels and gloo allocate inside an op, whose overlap with
the peak depends on how the processes' threads happen to run (4 processes on 2 loaded cores: up to 20%).

Second, the tensors alive, counted as the plan counts them (``fabriclite.plan.memory.MemoryTracker``), here on the
real tensors of the real run: each storage an op returns, from its creation until it is freed. The issue's measure
where torch has no allocator counters (the CPU); it repeats from run to run.

Also the peak of the tensors alive from the first forward of a module on (``stepping``): the plan's peak of the
steps, which leaves out building and setting up the model.

Third, what this rank handed to each collective in the second step, as gloo records its work for the profiler
(``gloo:all_reduce`` and the like, with the shapes and dtypes of the tensors handed in): gloo has no reduce-scatter
of its own and all-reduces the whole input instead.

Usage: ``fabriclite run --accelerator cpu --devices 2 tests/scripts/measure_memory.py examples/gpt/train.py --quick``
prints ``MEASURED <rank> <peak bytes> steps <steps> alive <peak bytes of tensors alive> stepping <the same from the
first forward on>`` on each rank, and
``SENT <rank> <collective> <bytes handed in during step 2>`` for each collective gloo ran in that step.
"""

import math
import os
import runpy
import sys

from torch.nn.modules.module import register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.profiler import ProfilerActivity, profile, record_function

from fabriclite.plan.memory import MemoryTracker

STEPS = 2
BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "bool": 1}


class Stop(BaseException):
    pass


def main() -> None:
    script, args = sys.argv[1], sys.argv[2:]
    done = [0]

    def count(optimizer, args, kwargs):
        done[0] += 1
        with record_function(f"measure: step {done[0]} ends"):  # marks where the step ends in the profile
            pass
        if done[0] >= STEPS:
            raise Stop

    register_optimizer_step_post_hook(count)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    alive, stepping = MemoryTracker(), MemoryTracker()
    alive.stepping = True  # one peak from the start, as the profiler's

    def first_forward(module, args):
        if not stepping.stepping:
            stepping.on_first_forward(module)

    register_module_forward_pre_hook(first_forward)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True) as prof, alive, stepping:
        try:
            runpy.run_path(script, run_name="__main__")
        except Stop:
            pass
    everything = prof.profiler.kineto_results.events()
    events = sorted((e for e in everything if e.name() == "[memory]"), key=lambda e: e.start_ns())
    live = peak = 0
    for event in events:
        live += event.nbytes()
        peak = max(peak, live)
    rank = os.environ.get("RANK", "0")
    print(f"MEASURED {rank} {peak} steps {done[0]} alive {alive.step_peak} stepping {stepping.step_peak}", flush=True)
    ends = {e.name(): e.start_ns() for e in everything if e.name().startswith("measure: step")}
    first, last = ends.get("measure: step 1 ends", 0), ends.get(f"measure: step {STEPS} ends", 0)
    sent: dict[str, int] = {}
    for event in everything:
        if event.name().startswith("gloo:") and first < event.start_ns() < last:
            handed = sum(math.prod(shape) * BYTES[dtype] for shape, dtype in zip(event.shapes(), event.dtypes()))
            sent[event.name()[5:]] = sent.get(event.name()[5:], 0) + handed
    for name, handed in sorted(sent.items()):
        print(f"SENT {rank} {name} {handed}", flush=True)


if __name__ == "__main__":
    main()
