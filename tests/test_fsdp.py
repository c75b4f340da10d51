"""FSDP2 on 2 CPU processes (gloo), started from a plain script as a user would; then loading its checkpoints into
one process, and a SIGKILL during sharded saves. Each script run carries a timeout."""

import os
import re
import time

import pytest
import torch
from helpers import SCRIPTS, assert_passed, passed, run_python, sigkill, start_python
from torch import nn

from fabriclite.checkpoint import CheckpointError
from fabriclite.checkpoint import load as load_checkpoint
from fabriclite.strategies.fsdp import FSDPStrategy, repeated_blocks

CHECKS = [
    "parameters are DTensors",
    "each rank holds about half of the parameters",
    "all_reduce of a DTensor reduces its full value",
    "all_gather of a DTensor gathers its full value",
    "broadcast of a DTensor sends its full value",
    "the repeated blocks are the sharding units",
    "an optimizer built before setup steps the shards",
    "FSDP equals one process on the whole batch",
    "FSDP equals DDP",
    "no_backward_sync reduces nothing",
    "gradients accumulated under no_backward_sync equal the unsharded sum",
    "clip_gradients returns the unsharded norm",
    "clip_gradients clips every shard by it",
    "an optimizer built after setup_module is kept as is",
    "an optimizer that already stepped is refused with what to do",
    "a sharded checkpoint is a directory with every rank's shards",
    "sharded checkpoint restores the step",
    "sharded: resuming mid-epoch reproduces the weights exactly",
    "sharded: and the optimizer state",
    "full checkpoint restores the step",
    "full: resuming mid-epoch reproduces the weights exactly",
    "full: and the optimizer state",
    "a class wrap policy shards those classes",
    "activation checkpointing and CPU offload train like one process",
    "bf16-mixed: the blocks run with bf16 weights gathered by FSDP",
    "bf16-mixed: outputs come back in fp32",
    "bf16-mixed: close to fp32",
    "bf16-mixed: gradients are reduced into fp32 shards",
    "an inf in one rank's shard makes every rank skip",
    "every rank backs off the scale",
    "after a skip the next step applies on every rank",
    "16-mixed: the user's GradScaler backs off on every rank",
    "16-mixed: a checkpoint restores into the user's GradScaler",
    "16-true: the user's ShardedGradScaler backs off on every rank",
    "16-true: a checkpoint restores into the user's ShardedGradScaler",
]
RANK_ZERO_CHECKS = ["a full checkpoint is one file of plain tensors that torch.load reads"]
ONE_PROCESS_CHECKS = [
    "one process without FSDP loads the 2-process full checkpoint",
    "one process without FSDP loads the 2-process sharded checkpoint",
    "FSDP on one process loads the 2-process full checkpoint",
    "FSDP on one process loads the 2-process sharded checkpoint",
    "consolidate writes the full checkpoint's content",
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tmp_path_factory.mktemp("fsdp")


@pytest.fixture(scope="module")
def two_process_run(checkpoints):
    return run_python(str(SCRIPTS / "fsdp_checks.py"), str(checkpoints), timeout=300).stdout


@pytest.fixture(scope="module")
def gradients_run(tmp_path_factory):
    return run_python(str(SCRIPTS / "sharded_gradients.py"), str(tmp_path_factory.mktemp("gradients")), timeout=300)


@pytest.mark.torch_versions
@pytest.mark.parametrize("mode", ["fsdp", "hsdp 2x1", "hsdp 1x2", "tp"])
def test_sharded_gradients_and_weights_equal_one_process_on_the_whole_batch(gradients_run, mode):
    # FSDP2 on torch 2.8 over gloo summed the two ranks' gradients (2x) until fabriclite asked it to divide itself.
    steps = [f"weights after step {step} equal one process's" for step in (1, 2, 3)]
    assert_passed(gradients_run.stdout, [f"{mode}: {name}" for name in ["gradients equal one process's", *steps]])


@pytest.mark.torch_versions
@pytest.mark.parametrize("mode", ["fsdp", "hsdp 2x1", "hsdp 1x2", "tp"])
def test_a_sharded_or_full_checkpoint_of_each_layout_resumes_exactly(gradients_run, mode):
    names = ["a checkpoint loads the weights saved", "the loaded model and optimizer step as the saved ones"]
    assert_passed(gradients_run.stdout, [f"{mode}: {name}" for name in names])


@pytest.fixture(scope="module")
def one_process_run(two_process_run, checkpoints):
    return run_python(str(SCRIPTS / "fsdp_load_one.py"), str(checkpoints), timeout=180).stdout


EMPTY_INIT_CHECKS = [
    "empty_init builds on the meta device on every rank",
    "each rank holds its shards only",
    "reset_parameters filled the shards",
    "a Linear gets its usual init",
    "the shards of one weight are not copies of each other",
    "every rank holds slices of the same weights",
    "an optimizer built over meta parameters and set up with the model steps the shards",
    "a checkpoint load fills an empty-init model",
    "an optimizer over meta parameters of a model not set up is refused in Lightning's words",
    "a module without reset_parameters is named in Lightning's warning",
]


def test_empty_init_builds_on_meta_everywhere_and_setup_fills_only_each_ranks_shards(tmp_path):
    out = run_python(str(SCRIPTS / "fsdp_empty_init.py"), str(tmp_path), timeout=300).stdout
    assert_passed(out, EMPTY_INIT_CHECKS)


LOAD_RAW_CHECKS = [
    f"{kind}: {check}"
    for kind in ("fsdp", "tp")
    for check in (
        "load_raw into a built model gives the weights of loading before sharding",
        "load_raw into an empty init gives the weights of loading before sharding",
        "strict load_raw refuses a file with a missing and an extra key, naming both, on every rank",
        "non-strict load_raw loads what both have and leaves the rest",
        "a tensor of another shape is refused on every rank, naming both shapes",
    )
] + ["fsdp: load_raw of a one-process optimizer state gives each rank its slices"]


def test_load_raw_of_a_full_state_dict_into_a_sharded_model_gives_each_rank_its_slice(tmp_path):
    out = run_python(str(SCRIPTS / "load_raw_sharded.py"), str(tmp_path), timeout=300).stdout
    assert_passed(out, LOAD_RAW_CHECKS)


@pytest.mark.parametrize("name", CHECKS)
def test_fsdp_behaviour_on_two_processes(two_process_run, name):
    assert {("0", name), ("1", name)} <= passed(two_process_run), two_process_run[-2000:]


@pytest.mark.parametrize("name", RANK_ZERO_CHECKS)
def test_fsdp_checkpoint_files_on_rank_zero(two_process_run, name):
    assert ("0", name) in passed(two_process_run), two_process_run[-2000:]


@pytest.mark.parametrize("name", ONE_PROCESS_CHECKS)
def test_checkpoints_of_two_processes_load_into_one(one_process_run, name):
    assert ("0", name) in passed(one_process_run), one_process_run[-2000:]


def test_consolidate_from_the_command_line_writes_a_file_torch_load_reads(one_process_run, checkpoints):
    out = checkpoints / "cli.pt"
    run_python("-m", "fabriclite.cli", "consolidate", str(checkpoints / "sharded.ckpt"), str(out), timeout=120)
    consolidated, full = torch.load(out, weights_only=True), torch.load(checkpoints / "full.ckpt", weights_only=True)
    assert consolidated["model"].keys() == full["model"].keys()
    assert all(torch.equal(consolidated["model"][k], full["model"][k]) for k in full["model"])
    assert (
        consolidated["optimizer"]["state"].keys() == full["optimizer"]["state"].keys() == set(range(len(full["model"])))
    )


def test_sigkill_during_sharded_saves_leaves_the_last_checkpoint_loadable(tmp_path):
    """Two processes save a 64 MB sharded checkpoint over and over; we SIGKILL the run (rank 0; rank 1 dies with
    it) while a save is being written, load what is there, restart from it, and kill it again."""
    path = tmp_path / "loop.ckpt"
    kills_during_write, versions = 0, []
    for attempt in range(2):
        child = start_python(str(SCRIPTS / "fsdp_save_forever.py"), str(path))
        lines, target = [], (versions[-1] if versions else 0) + 2  # at least one save replaced an older one
        try:
            for line in child.stdout:
                lines.append(line.strip())
                if line.startswith("saved") and int(line.split()[1]) >= target:
                    break
            time.sleep(0.05 + 0.1 * attempt)
            writing = any(name.startswith(".loop.ckpt.tmp-") for name in os.listdir(tmp_path))
        finally:
            sigkill(child)
        pids = [int(pid) for pid in re.findall(r"PID \d (\d+)", "\n".join(lines))]
        time.sleep(0.5)
        assert len(pids) == 2 and not any(_alive(pid) for pid in pids), lines
        kills_during_write += writing
        checkpoint, _ = load_checkpoint(path, None)
        versions.append(checkpoint["version"])
        assert all(torch.equal(t, torch.full_like(t, versions[-1])) for t in checkpoint["model"].values())
        if attempt == 1:
            assert f"resumed {versions[0]}" in lines
    assert versions[1] > versions[0]
    assert kills_during_write > 0, "no kill landed while a save was being written; the test proved nothing"


def _alive(pid):
    # A killed rank whose parent died too may stay a zombie until init reaps it: that counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))

    def forward(self, x):
        return self.mlp(x)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Sequential(nn.LayerNorm(4), nn.Linear(4, 2))


def test_default_units_are_the_repeated_blocks_outermost_only():
    net = Net()
    assert repeated_blocks(net) == list(net.blocks)


def test_default_units_skip_parameterless_repeats_and_single_layers():
    mlp = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 3), nn.ReLU(), nn.LayerNorm(3))
    assert repeated_blocks(mlp) == [mlp[0], mlp[2]]
    assert repeated_blocks(nn.Linear(2, 2)) == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"state_dict_type": "shard"}, ValueError, "Valid choices: 'sharded', 'full'"),
        ({"auto_wrap_policy": {int}}, TypeError, "must hold nn.Module subclasses"),
        ({"activation_checkpointing_policy": 3}, TypeError, "none of the forms a policy takes"),
        ({"mixed_precision": "bf16"}, TypeError, "MixedPrecisionPolicy"),
    ],
)
def test_invalid_options_say_what_is_valid(kwargs, error, match):
    with pytest.raises(error, match=match):
        FSDPStrategy(**kwargs)


def test_fsdp1_arguments_litgpt_passes_are_accepted_with_one_warning_saying_fsdp2_has_no_such_setting():
    with pytest.warns(UserWarning) as caught:
        strategy = FSDPStrategy(
            auto_wrap_policy={Block},
            activation_checkpointing_policy={Block},
            state_dict_type="full",
            limit_all_gathers=True,
            cpu_offload=False,
            use_orig_params=True,
        )
    messages = [str(w.message) for w in caught if "FSDP2" in str(w.message)]
    assert len(messages) == 1
    assert "no setting for limit_all_gathers, use_orig_params, so they are ignored" in messages[0]
    net = Net()
    assert list(strategy.checkpoint_policy.select(net)) == list(net.blocks) and strategy.cpu_offload is False
    assert strategy.state_dict_type == "full"


def test_fsdp1_objects_are_translated_to_their_fsdp2_policies():
    from torch.distributed.fsdp import CPUOffload, CPUOffloadPolicy, MixedPrecision, ShardingStrategy

    strategy = FSDPStrategy(
        cpu_offload=CPUOffload(offload_params=True),
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
    )
    policy = strategy.mixed_precision
    assert (policy.param_dtype, policy.reduce_dtype, policy.cast_forward_inputs) == (
        torch.bfloat16,
        torch.float32,
        True,
    )
    assert strategy.cpu_offload is True and strategy.reshard_after_forward is False
    assert FSDPStrategy(cpu_offload=CPUOffload(offload_params=False)).cpu_offload is False
    own = CPUOffloadPolicy(pin_memory=False)
    assert FSDPStrategy(cpu_offload=own)._offload_policy is own
    with pytest.warns(UserWarning, match="mixed_precision.buffer_dtype: FSDP2 leaves buffers in their own dtype"):
        FSDPStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16))
    linear = nn.Linear(1, 1)
    assert list(FSDPStrategy(activation_checkpointing=nn.Linear).checkpoint_policy.select(nn.Sequential(linear))) == [
        linear
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"process_group": None}, ValueError, r"FSDPStrategy\(process_group=...\) is an FSDP1 argument.*device_mesh"),
        ({"param_init_fn": None}, ValueError, r"param_init_fn.*init_module\(empty_init=True\)"),
        ({"ignored_modules": []}, ValueError, r"ignored_modules.*ModelParallelStrategy\(parallelize_fn\)"),
        ({"device_id": 0}, ValueError, r"device_id.*Fabric\(devices=...\)"),
        ({"limit_all_gather": True}, TypeError, "unexpected keyword argument 'limit_all_gather'.*limit_all_gathers"),
        ({"cpu_offload": "yes"}, TypeError, "cpu_offload='yes' must be a bool"),
        (
            {"activation_checkpointing": nn.Linear, "activation_checkpointing_policy": {nn.Linear}},
            ValueError,
            "pass activation_checkpointing_policy only",
        ),
    ],
)
def test_fsdp1_arguments_without_an_fsdp2_meaning_are_refused_saying_what_to_use(kwargs, error, match):
    with pytest.raises(error, match=match):
        FSDPStrategy(**kwargs)


def test_a_custom_policys_settings_for_a_unit_become_fully_shard_arguments_and_others_are_refused():
    from torch.distributed.fsdp import MixedPrecision, MixedPrecisionPolicy, ShardingStrategy
    from torch.distributed.fsdp.wrap import CustomPolicy

    from fabriclite.strategies.fsdp import _unit_options
    from fabriclite.strategies.policies import WrapPolicy

    policy = WrapPolicy(CustomPolicy(lambda m: True), "auto_wrap_policy")
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    assert _unit_options({"sharding_strategy": ShardingStrategy.SHARD_GRAD_OP}, policy, "flat") == {
        "reshard_after_forward": False
    }
    assert _unit_options({"sharding_strategy": "HYBRID_SHARD"}, policy, "hybrid") == {"reshard_after_forward": True}
    assert _unit_options({"mixed_precision": None, "limit_all_gathers": True}, policy, "flat") == {
        "mp_policy": MixedPrecisionPolicy()  # FSDP1's None: this unit in full precision
    }
    assert (
        _unit_options({"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}, policy, "flat")[
            "mp_policy"
        ].param_dtype
        == torch.bfloat16
    )
    assert _unit_options({"mp_policy": bf16, "reshard_after_forward": 2}, policy, "flat") == {
        "mp_policy": bf16,
        "reshard_after_forward": 2,
    }
    with pytest.raises(
        ValueError, match="sharding_strategy='HYBRID_SHARD' for a unit.*may take 'FULL_SHARD' or 'SHARD_GRAD_OP'"
    ):
        _unit_options({"sharding_strategy": "HYBRID_SHARD"}, policy, "flat")
    with pytest.raises(ValueError, match="returned cpu_offload=True for a unit.*set it on FSDPStrategy"):
        _unit_options({"cpu_offload": True}, policy, "flat")


def test_a_custom_checkpointing_policys_settings_are_torch_checkpoint_options_and_reentrancy_is_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl
    from torch.distributed.fsdp.wrap import CustomPolicy

    from fabriclite.strategies.fsdp import _checkpoint_options
    from fabriclite.strategies.policies import WrapPolicy

    policy = WrapPolicy(CustomPolicy(lambda m: True), "activation_checkpointing_policy")
    given = {"checkpoint_impl": CheckpointImpl.NO_REENTRANT, "preserve_rng_state": False, "use_reentrant": False}
    assert _checkpoint_options(given, policy) == {"preserve_rng_state": False, "use_reentrant": False}
    with pytest.raises(ValueError, match="reentrant checkpointing, which does not compose with FSDP2"):
        _checkpoint_options({"checkpoint_impl": CheckpointImpl.REENTRANT}, policy)
    with pytest.raises(ValueError, match="returned checkpoint_fn for a module.*preserve_rng_state"):
        _checkpoint_options({"checkpoint_fn": print}, policy)


def test_fsdp_and_model_parallel_are_siblings_as_in_lightning():
    from fabriclite.strategies import ModelParallelStrategy, ParallelStrategy

    fsdp, model_parallel = FSDPStrategy(), ModelParallelStrategy(lambda model, mesh: model)
    assert not isinstance(model_parallel, FSDPStrategy) and not isinstance(fsdp, ModelParallelStrategy)
    assert isinstance(fsdp, ParallelStrategy) and isinstance(model_parallel, ParallelStrategy)
    assert fsdp._sharding is not model_parallel._sharding  # each holds its own setup state


def test_a_directory_without_fabriclite_structure_is_refused_by_name(tmp_path):
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*manifest.json") as caught:
        load_checkpoint(tmp_path, None)
    assert caught.value.reason == "incomplete"
    with pytest.raises(CheckpointError, match=f"{tmp_path}.*structure.pt") as caught:
        load_checkpoint(tmp_path, None, verify=False)
    assert caught.value.reason == "not a checkpoint"


OVERLAP_CHECKS = [
    "a block's optimizer steps before the backward reaches the first layer",
    "no gradient is left after the block",
    "overlapping the step with backward trains as stepping after it",
    "under no_backward_sync the steps wait for the backward that syncs",
    "one optimizer over the whole model steps once per backward",
    "an optimizer over another model's parameters is refused",
    "a loss scaler is refused, saying what to use",
]


@pytest.mark.torch_versions  # FSDP2 running post-accumulate-grad hooks after its reduce-scatter, on each torch
def test_fsdp_overlap_step_with_backward_steps_inside_the_backward_and_trains_as_stepping_after_it():
    out = run_python(str(SCRIPTS / "fsdp_overlap.py"), timeout=300).stdout
    assert_passed(out, OVERLAP_CHECKS)


def test_fsdp_overlap_step_with_backward_refuses_a_model_fsdp_did_not_shard_saying_what_to_do():
    from fabriclite.strategies.fsdp import fsdp_overlap_step_with_backward  # Lightning's import path

    model = nn.Linear(2, 2)
    with pytest.raises(
        TypeError, match="takes the model fabric.setup returned under FSDPStrategy.*step after backward"
    ):
        with fsdp_overlap_step_with_backward(torch.optim.SGD(model.parameters(), lr=0.1), model):
            pass


def test_compile_under_fsdp_compiles_each_block_and_the_root_only_when_whole_without_graph_breaks():
    out = run_python(str(SCRIPTS / "compile_checks.py"), timeout=240).stdout
    for name in (
        "every block is compiled",
        "the root stays eager",
        "regional=False compiles every block and the root",
        "no graph breaks",
        "compiled training equals eager",
    ):
        assert f"PASS 0 {name}" in out and f"PASS 1 {name}" in out, out[-2000:]
