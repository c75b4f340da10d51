"""Model parallelism and hybrid sharding on 2x2 meshes of 4 CPU processes (gloo): ModelParallelStrategy (tensor
parallel x FSDP2 through the user's parallelize_fn) and FSDPStrategy's HYBRID_SHARD and NO_SHARD. Each run trains
as one process does on the full batch and resumes identically from a sharded checkpoint; tests/scripts/mesh_checks.py
holds the checks. Every multi-process run carries a timeout."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from fabriclite import Fabric
from fabriclite.plugins.environments import free_port
from fabriclite.strategies import ModelParallelStrategy
from helpers import SCRIPTS, assert_passed, run_python

TRAINING_CHECKS = [
    "the mesh has the expected shape",
    "parameters are DTensors on the mesh",
    "every step's loss equals one process on the full batch",
    "a loaded checkpoint resumes with the same losses",
    "an empty init equals a normal one",
    "a metric counts every sample once",
]
RANKS = ("0", "1", "2", "3")


def names(mode, checks):
    return [f"{mode}: {check}" for check in checks]


@pytest.fixture(scope="module")
def mesh_folder(tmp_path_factory):
    return tmp_path_factory.mktemp("mesh")


@pytest.fixture(scope="module")
def four_process_run(mesh_folder):
    return run_python(str(SCRIPTS / "mesh_checks.py"), str(mesh_folder), "hsdp,noshard,tp", timeout=600).stdout


@pytest.mark.parametrize("mode", ["tp", "hsdp", "noshard"])
def test_a_2x2_mesh_trains_as_one_process_and_resumes_identically(four_process_run, mode):
    placement = "up is split over both dimensions" if mode == "tp" else "replicated across groups, sharded within"
    assert_passed_four(four_process_run, names(mode, [*TRAINING_CHECKS, placement]))


def test_a_checkpoint_of_one_mesh_layout_resumes_under_another(four_process_run):
    # The run does hsdp before tp; tp loads hsdp's mid-run checkpoint and must go on as one process would.
    assert_passed_four(four_process_run, names("tp", ["a checkpoint of the hsdp mesh resumes here"]))


def test_a_parallelize_fn_that_returns_nothing_shards_nothing_or_misnames_the_mesh_is_refused(four_process_run):
    checks = [
        "a parallelize_fn returning nothing is refused",
        "a parallelize_fn sharding nothing is refused",
        "a mesh dimension name that does not exist is named",
    ]
    assert_passed_four(four_process_run, names("tp", checks))


@pytest.mark.parametrize("mode", ["tp", "hsdp"])
def test_a_mesh_checkpoint_consolidates_and_loads_into_one_plain_process(four_process_run, mesh_folder, tmp_path, mode):
    """The 4-process sharded folder, resharded by DCP onto one process without any mesh, and consolidated into one
    file plain torch.load reads: the same trained weights both ways."""
    import sys

    sys.path.insert(0, str(SCRIPTS))
    from mesh_checks import Net

    folder = mesh_folder / mode / "mid.ckpt"
    run_python("-m", "fabriclite.cli", "consolidate", str(folder), str(tmp_path / "one.pt"), timeout=120)
    consolidated = torch.load(tmp_path / "one.pt", weights_only=True)["model"]
    model = Net()
    Fabric(accelerator="cpu").load(folder, {"model": model}, strict=False)
    torch.manual_seed(0)
    initial = Net().state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, consolidated[name]), name
        assert not torch.equal(tensor, initial[name]), f"{name} was not trained"


def test_two_nodes_over_loopback_build_the_mesh_nodes_by_devices(tmp_path):
    """`fabriclite run --num-nodes 2 --devices 2` on loopback: the defaults put tensor parallelism and sharding
    inside a node and data parallelism and replication across nodes."""
    port = str(free_port())

    def node(rank):
        return run_python(
            "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--num-nodes", "2", "--node-rank", str(rank),
            "--devices", "2", "--main-address", "127.0.0.1", "--main-port", port, str(SCRIPTS / "mesh_checks.py"),
            str(tmp_path), "hsdp,tp", "cli", timeout=600,
        ).stdout  # fmt: skip

    with ThreadPoolExecutor(2) as pool:
        output = "".join(pool.map(node, [0, 1]))
    for mode in ("hsdp", "tp"):
        assert_passed_four(output, names(mode, TRAINING_CHECKS))


def assert_passed_four(output, checks):
    assert_passed(output, checks, ranks=RANKS)


def test_sizes_that_do_not_multiply_to_the_world_size_are_refused():
    # In a child process: a launch sets the launch variables and a process group in the process that runs it.
    code = """
from fabriclite import Fabric
from fabriclite.strategies import FSDPStrategy, ModelParallelStrategy
for strategy in (ModelParallelStrategy(lambda m, mesh: m, 2, 1), FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 2))):
    try:
        Fabric(accelerator="cpu", devices=1, strategy=strategy).launch()
    except ValueError as err:
        print(err)
"""
    out = run_python("-c", code, timeout=120).stdout
    assert "data_parallel_size * tensor_parallel_size = 2 * 1 = 2, but the world size is 1" in out, out
    assert "device_mesh=(2, 2) holds 4 processes, but the world size is 1" in out, out


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"parallelize_fn": "tp"}, TypeError, "parallelize_fn='tp' must be a function"),
        (
            {"parallelize_fn": lambda m, mesh: m, "tensor_parallel_size": 0},
            ValueError,
            "tensor_parallel_size=0 must be",
        ),
        (
            {"parallelize_fn": lambda m, mesh: m, "data_parallel_size": "2"},
            ValueError,
            "data_parallel_size='2' must be",
        ),
    ],
)
def test_invalid_model_parallel_options_say_what_is_valid(kwargs, error, match):
    with pytest.raises(error, match=match):
        ModelParallelStrategy(**kwargs)


def test_one_process_runs_the_parallelize_fn_on_a_1x1_mesh_and_exposes_it():
    code = """
import torch
from torch import nn
from fabriclite import Fabric
from fabriclite.strategies import ModelParallelStrategy
seen = {}
def parallelize(model, mesh):
    seen["dims"] = mesh.mesh_dim_names
    return model
fabric = Fabric(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(parallelize))
fabric.launch()
model = fabric.setup(nn.Linear(2, 2))
print(seen["dims"], tuple(fabric.device_mesh.shape), bool(torch.isfinite(model(torch.ones(1, 2))).all()))
"""
    out = run_python("-c", code, timeout=120).stdout
    assert "('data_parallel', 'tensor_parallel') (1, 1) True" in out, out
    with pytest.raises(AttributeError, match="SingleDeviceStrategy has no device mesh"):
        _ = Fabric(accelerator="cpu").device_mesh
