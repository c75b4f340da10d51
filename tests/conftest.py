import os
import signal
import threading

# The kernels run through Triton's interpreter on CPU tensors. Triton reads this when it is imported and when a
# kernel is decorated, and torch.compile may import triton early, so it is set before any test module is imported.
# On a CUDA machine, TRITON_INTERPRET=0 runs the kernel tests compiled.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch


def pytest_configure(config):
    # A shell starts a background job (`pytest ... &` in a script) with SIGINT ignored, and an ignored signal stays
    # ignored in every process started from it: the tests that interrupt a run with SIGINT would wait for ever. A
    # handler of Python's own here makes the processes this one starts (xdist's workers, then the tests' children)
    # begin with SIGINT at its default, as from a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# What a launcher writes into a process's environment. A test that runs a launch inside the pytest process would
# leave them behind, and every later test's child processes would inherit a stale "you are rank 0 of 1".
LAUNCH_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "FABRICLITE_LAUNCHER",
)


@pytest.fixture(autouse=True)
def _no_launch_variables_leak():
    before = {name: os.environ.get(name) for name in LAUNCH_VARIABLES}
    yield
    leaked = {name: os.environ[name] for name in LAUNCH_VARIABLES if os.environ.get(name) != before[name]}
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    assert not leaked, f"the test left launch variables in the pytest process: {leaked}; run its launch in a subprocess"
