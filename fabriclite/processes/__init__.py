"""The process layer: everything about the processes of a run, and nothing about training.

- ``signals``: what every signal does to a process (preemption notices, interrupts), one state machine.
- ``preemption``: every rank agreeing on a notice (``fabric.preempted``), and the end of a preempted script.
- ``launcher``: one interface, ``launch(fn, *args)``: in place, by re-running the script, or by spawning.
- ``supervisor``: watching and restarting the ranks of one machine (``fabriclite run --max-restarts``).
- ``failures``: what a rank that failed tells its supervisor; which rank failed first; a failure that repeats.
- ``nodes``: a run on several machines (``fabriclite run --num-nodes``): torch's elastic agent, with our additions.
- ``torchelastic``: ranks that torch's agent started (torchrun): a fresh store per group, the first failure named.
- ``watchdog``: the report of a rank that stalls, and of processes that never join.

Where a process sits in the run (torchrun, SLURM, our own launcher) is ``plugins/environments.py``, Lightning's path.
"""
