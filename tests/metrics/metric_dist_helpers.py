"""Real process groups for the metric tests: the one place these tests start processes, every wait with a timeout.

Usage (in a test): ``results = run_cases("test_metric_distributed", ["case_a", "case_b"], world_size=2)`` returns one
``{case: "ok" or the traceback}`` dict per rank. Each rank is this file run as a script: it joins a gloo group over
TCP on a free port, runs the named functions of the module's ``CASES`` dict with ``(rank, world_size)`` one after
the other in the same group (so the start-up cost is paid once), and writes its results as JSON.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
COLLECTIVE_TIMEOUT_S = 30  # a case stuck in a collective fails after this instead of hanging the run


def free_port() -> int:
    """A TCP port nothing listens on right now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cases(module: str, cases: list[str], world_size: int = 2, timeout: float = 150) -> list[dict[str, str]]:
    """Run ``cases`` of ``module`` on ``world_size`` gloo processes; kill them all if they outlive ``timeout``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), str(HERE), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        outputs = [Path(tmp, f"rank{rank}.json") for rank in range(world_size)]
        logs = [Path(tmp, f"rank{rank}.log") for rank in range(world_size)]
        processes = []
        try:
            for rank in range(world_size):
                # a file, not a pipe, for the output: a rank blocked writing to a full pipe would stall the group
                with open(logs[rank], "w") as log:
                    processes.append(
                        subprocess.Popen(
                            [
                                sys.executable,
                                __file__,
                                module,
                                str(rank),
                                str(world_size),
                                str(port),
                                str(outputs[rank]),
                                *cases,
                            ],
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env=env,
                            cwd=ROOT,
                        )
                    )
            deadline = time.monotonic() + timeout
            for process in processes:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise AssertionError(f"The process group outlived {timeout}s\n{_tails(logs)}") from None
        finally:
            for process in processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(timeout=10)
        failed = [rank for rank, p in enumerate(processes) if p.returncode != 0]
        if failed:
            raise AssertionError(f"Ranks {failed} exited with an error\n{_tails(logs)}")
        return [json.loads(path.read_text()) for path in outputs]


def _tails(logs: list[Path]) -> str:
    return "\n".join(
        f"--- rank {rank}:\n{path.read_text()[-4000:] if path.exists() else ''}" for rank, path in enumerate(logs)
    )


def _main(module_name: str, rank: int, world_size: int, port: int, output: str, cases: list[str]) -> None:
    import importlib
    import traceback
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    registry = importlib.import_module(module_name).CASES
    results = {}
    for name in cases:
        try:
            registry[name](rank, world_size)
            results[name] = "ok"
        except Exception:
            results[name] = traceback.format_exc()
    Path(output).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    _, module_name, rank, world_size, port, output, *case_names = sys.argv
    _main(module_name, int(rank), int(world_size), int(port), output, case_names)
