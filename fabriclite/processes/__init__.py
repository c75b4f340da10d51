"""The process layer: everything about the processes of a run, and nothing about training.

- ``signals``: what every signal does to a process (preemption notices, interrupts), one state machine.
- ``preemption``: every rank agreeing on a notice (``fabric.preempted``), and the end of a preempted script.
- ``launcher``: one interface, ``launch(fn, *args)``: in place, by re-running the script, or by spawning.
- ``supervisor``: watching and restarting the ranks of one machine (``fabriclite run --max-restarts``).
- ``failures``: what a rank that failed tells its supervisor; which rank failed first; a failure that repeats.
- ``nodes``: the supervisors of a run on several machines, kept in step through node 0's store.
- ``watchdog``: the report of a rank that stalls, and of processes that never join.

Where a process sits in the run (torchrun, SLURM, our own launcher) is ``plugins/environments.py``, Lightning's path.
"""
