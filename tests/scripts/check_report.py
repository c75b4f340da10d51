"""How check scripts report: one "PASS <rank> <name>" line per check, written in one syscall because the ranks of a
run share one pipe; a failed check raises, naming the rank."""

import os


def report(rank, name, condition, detail=""):
    if not condition:
        raise AssertionError(f"rank {rank}: {name} failed {detail}".rstrip())
    os.write(1, f"PASS {rank} {name}\n".encode())
