"""The strategies through their own interface: choosing one from a name, where each gets its launcher and process
layout, what travels to a new process, checkpoint files through a CheckpointIO, and DDP and FSDP on 2 real
processes (gloo) with no Fabric in between."""

import pickle
from datetime import timedelta

import pytest
import torch
from torch import nn

from fabriclite import Fabric
from fabriclite.accelerators import CPUAccelerator
from fabriclite.checkpoint import TorchCheckpointIO
from fabriclite.processes.launcher import InProcessLauncher, MultiprocessingLauncher, SubprocessLauncher
from fabriclite.plugins import MixedPrecision, Precision
from fabriclite.strategies import DDPStrategy, FSDPStrategy, SingleDeviceStrategy, Strategy, select_strategy
from helpers import LAUNCH_VARS, SCRIPTS, assert_passed, run_python


@pytest.fixture
def plain_process(monkeypatch):
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    ("name", "devices", "cls", "launcher"),
    [
        ("auto", 1, SingleDeviceStrategy, InProcessLauncher),
        ("single_device", 1, SingleDeviceStrategy, InProcessLauncher),
        ("auto", 2, DDPStrategy, SubprocessLauncher),
        ("ddp", 2, DDPStrategy, SubprocessLauncher),
        ("ddp_spawn", 2, DDPStrategy, MultiprocessingLauncher),
        ("fsdp", 2, FSDPStrategy, SubprocessLauncher),
    ],
)
def test_a_name_selects_a_strategy_and_configure_gives_it_its_launcher(plain_process, name, devices, cls, launcher):
    accelerator = CPUAccelerator(list(range(devices)))
    strategy = select_strategy(name, accelerator, num_nodes=1)
    strategy.configure(accelerator, 1)
    assert type(strategy) is cls and type(strategy.launcher) is launcher
    assert (strategy.world_size, strategy.global_rank, strategy.root_device) == (devices, 0, torch.device("cpu"))


def test_a_strategy_object_is_taken_as_it_is_and_anything_else_is_refused():
    mine = DDPStrategy(timeout=timedelta(minutes=1))
    assert select_strategy(mine, CPUAccelerator([0, 1]), 1) is mine
    for bad in ("deepspeed_stage_9", object()):
        with pytest.raises(ValueError, match="Valid choices: 'auto', 'single_device'"):
            select_strategy(bad, CPUAccelerator([0]), 1)


def test_processes_already_started_run_in_place_with_their_layout(plain_process):
    for name, value in {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29999",
        "NODE_RANK": "1",
    }.items():
        plain_process.setenv(name, value)
    strategy = DDPStrategy()
    strategy.configure(CPUAccelerator([0, 1]), num_nodes=2)
    assert type(strategy.launcher) is InProcessLauncher
    assert (strategy.world_size, strategy.global_rank, strategy.local_rank, strategy.node_rank) == (4, 3, 1, 1)
    with pytest.raises(ValueError, match="WORLD_SIZE=4.*devices \\* num_nodes = 2 \\* 1 = 2"):
        DDPStrategy().configure(CPUAccelerator([0, 1]), num_nodes=1)


def test_several_nodes_need_a_launcher_that_starts_them(plain_process):
    with pytest.raises(ValueError, match="num_nodes=2 needs the processes to be started by torchrun"):
        DDPStrategy().configure(CPUAccelerator([0, 1]), num_nodes=2)


def test_the_single_device_strategy_has_nobody_to_exchange_with():
    strategy = SingleDeviceStrategy()
    strategy.configure(CPUAccelerator([0]))
    strategy.setup_environment()
    tensor = torch.arange(3)
    assert strategy.all_reduce(tensor) is tensor and strategy.all_gather(tensor) is tensor
    assert strategy.broadcast("x") == "x" and strategy.all_gather_object(1) == [1]


def test_a_strategy_travels_to_a_new_process_without_what_it_built_here(plain_process):
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, start_method="spawn")
    strategy.configure(CPUAccelerator([0, 1]))
    optimizer = torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=0.1)
    strategy._sharding.optimizers.add(optimizer)
    arrived = pickle.loads(pickle.dumps(strategy))
    assert type(arrived.launcher) is InProcessLauncher  # in a new process, the processes exist already
    assert len(arrived._sharding.optimizers) == 0 and arrived.mesh is None and arrived.environment is None
    model = nn.Sequential(nn.Linear(1, 1), nn.ReLU())
    assert list(arrived.wrap_policy.select(model)) == [model[0]]
    assert len(strategy._sharding.optimizers) == 1  # the original keeps its own


class HalfParams(Precision):
    """A precision of the user's own: no name FSDP knows, only the dtype it says its parameters compute in."""

    name = "mine"
    param_dtype = torch.float16


@pytest.mark.parametrize(
    ("precision", "param_dtype"),
    [
        (Precision(), None),
        (MixedPrecision("bf16-mixed", torch.device("cpu")), torch.bfloat16),
        (HalfParams(), torch.float16),
    ],
)
def test_fsdp_casts_parameters_to_what_the_precision_object_says(precision, param_dtype):
    strategy = FSDPStrategy()
    strategy.precision = precision
    policy = strategy._mixed_precision_policy()
    assert policy.param_dtype == param_dtype
    assert policy.reduce_dtype == (torch.float32 if param_dtype else None)


class RecordingIO(TorchCheckpointIO):
    def __init__(self):
        self.calls = []

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        self.calls.append(("save", sorted(checkpoint)))
        super().save_checkpoint(checkpoint, path, storage_options)

    def load_checkpoint(self, path, map_location="cpu", weights_only=True):
        self.calls.append(("load", weights_only))
        return super().load_checkpoint(path, map_location, weights_only)


def test_checkpoint_files_go_through_the_checkpoint_io_plugin(tmp_path):
    io = RecordingIO()
    fabric = Fabric(accelerator="cpu", plugins=[io])
    assert fabric.strategy.checkpoint_io is io
    model = fabric.setup(nn.Linear(2, 2))
    fabric.save(tmp_path / "a.ckpt", {"model": model, "step": 3})
    state = {"model": model, "step": 0}
    fabric.load(tmp_path / "a.ckpt", state)
    assert state["step"] == 3
    assert io.calls == [("save", ["__fabriclite__", "model", "step"]), ("load", True)]


def test_two_plugins_of_one_kind_are_refused_by_name():
    with pytest.raises(ValueError, match="two Precision plugins"):
        Fabric(accelerator="cpu", plugins=[Precision(), Precision()])
    with pytest.raises(ValueError, match="two CheckpointIO plugins"):
        Fabric(accelerator="cpu", plugins=[TorchCheckpointIO(), TorchCheckpointIO()])


def test_every_strategy_is_a_strategy():
    assert all(issubclass(cls, Strategy) for cls in (SingleDeviceStrategy, DDPStrategy, FSDPStrategy))


CHECKS = [
    "layout",
    "broadcast",
    "all_gather_object",
    "all_reduce mean of integers is a float",
    "all_gather of uneven lengths",
    "the shards cover the data once",
    "gradients are averaged across ranks",
    "a checkpoint round-trips",
]


@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_a_distributed_strategy_runs_two_processes_through_its_own_interface(kind):
    out = run_python(str(SCRIPTS / "strategy_checks.py"), kind, timeout=240).stdout
    assert_passed(out, CHECKS)
    assert_passed(out, ["rank 0's result comes back"], ranks=("0",))


_ANNOUNCED = """
import logging, sys
from fabriclite import Fabric
if "quiet" in sys.argv:
    logging.getLogger("fabriclite").setLevel(logging.WARNING)  # as a script silences Lightning's info lines
fabric = Fabric(accelerator="cpu", devices=int(sys.argv[1]), strategy=sys.argv[2], precision="bf16-mixed")
fabric.launch()
"""


def test_a_run_says_on_rank_zero_what_runs_in_lightnings_words_and_is_silenced_as_lightnings(tmp_path):
    script = tmp_path / "announced.py"  # a file: the launcher runs it again for rank 1
    script.write_text(_ANNOUNCED)
    one = run_python(str(script), "1", "auto", timeout=120).stderr
    assert one.splitlines() == [
        "Using bfloat16 Automatic Mixed Precision (AMP)",
        "fabriclite: SingleDeviceStrategy, 1 process, cpu, precision bf16-mixed",
    ], one
    two = run_python(str(script), "2", "ddp", timeout=300).stderr
    # Each rank says it joins (as Lightning's log.info), rank 0 alone the rest, once.
    for line in (
        "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/2",
        "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2",
    ):
        assert two.count(line) == 1, two
    for line in (
        "Using bfloat16 Automatic Mixed Precision (AMP)",
        "distributed_backend=gloo",
        "All distributed processes registered. Starting with 2 processes",
        "fabriclite: DDPStrategy, 2 processes, cpu, precision bf16-mixed",
    ):
        assert two.count(line) == 1, two
    quiet = run_python(str(script), "2", "ddp", "quiet", timeout=300).stderr
    assert "Automatic Mixed Precision" not in quiet and "fabriclite: " not in quiet, quiet
    assert "Initializing distributed" not in quiet and "registered" not in quiet, quiet
