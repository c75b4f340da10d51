"""What Lightning Fabric user code relies on the Fabric object and its wrappers to do, beyond the names it imports:
methods other than forward under DDP/FSDP, scripts without launch() under the run CLI, LightningModules, callback
hooks, and wrapper details. Multi-process runs carry timeouts."""

import warnings
from importlib.util import find_spec

import pytest
import torch
from torch import nn

from fabriclite import Fabric
from fabriclite.strategies import DDPStrategy
from helpers import SCRIPTS, assert_passed, run_python


FORWARD_METHOD_CHECKS = [
    "training_step gradients are averaged",
    "a marked method's gradients are averaged",
    "an unmarked method that runs the model is refused",
    "a method that runs no layer works",
    "forward is itself again",
]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_methods_other_than_forward_synchronise_or_refuse_on_two_processes(strategy):
    out = run_python(str(SCRIPTS / "forward_methods.py"), strategy, timeout=240).stdout
    assert_passed(out, FORWARD_METHOD_CHECKS)


def test_a_script_without_launch_trains_under_the_run_cli():
    out = run_python(
        "-m",
        "fabriclite.cli",
        "run",
        "--accelerator",
        "cpu",
        "--devices",
        "2",
        str(SCRIPTS / "no_launch.py"),
        timeout=240,
    ).stdout
    assert_passed(out, ["trained on 2 processes without launch"])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch):
        return self(batch).sum()


def test_on_one_device_methods_are_the_models_own():
    model = Fabric(accelerator="cpu").setup(Net())
    assert model.training_step(torch.ones(1, 2)).shape == ()
    assert model.training_step.__func__ is Net.training_step  # nothing in between


def test_mark_forward_method_names_what_is_wrong():
    model = Fabric(accelerator="cpu").setup(Net())
    with pytest.raises(AttributeError, match="Net has no method 'nothing'"):
        model.mark_forward_method("nothing")
    with pytest.raises(ValueError, match="You cannot mark the forward method itself"):
        model.mark_forward_method("forward")
    with pytest.raises(TypeError, match="the method's name or the bound method"):
        model.mark_forward_method(3)
    model.mark_forward_method(model.module.training_step)  # a bound method is fine


def test_the_wrapped_model_knows_its_device():
    fabric = Fabric(accelerator="cpu")
    assert fabric.setup(Net()).device == fabric.device
    assert fabric.setup(Net(), move_to_device=False).device == torch.device("cpu")


def test_a_new_attribute_set_on_the_wrapped_model_reaches_the_original():
    net = Net()
    model = Fabric(accelerator="cpu").setup(net)
    model.threshold = 0.5
    assert net.threshold == 0.5 and model.threshold == 0.5
    model.train(False)
    assert not net.training and not model.training


def test_the_same_raw_model_can_be_set_up_twice_but_not_a_wrapped_one():
    fabric = Fabric(accelerator="cpu")
    net = Net()
    first, second = fabric.setup(net), fabric.setup(net)
    assert first is not second and first.module is second.module is net
    with pytest.raises(ValueError, match="should be passed only once"):
        fabric.setup(first)


class Recorder:
    def __init__(self):
        self.calls = []

    def on_after_setup(self, fabric, module):
        self.calls.append(("setup", fabric, module))

    def on_after_optimizer_step(self, strategy, optimizer):
        self.calls.append(("step", strategy, optimizer))

    def on_epoch_end(self, results):  # takes only some of the keywords fabric.call passes
        self.calls.append(("epoch", results))


def test_callbacks_hear_of_setup_and_every_optimizer_step():
    recorder = Recorder()
    fabric = Fabric(accelerator="cpu", callbacks=[recorder])
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    other = fabric.setup_module(Net())
    for _ in range(2):
        fabric.backward(model(torch.ones(1, 2)).sum())
        optimizer.step()
    assert recorder.calls[:2] == [("setup", fabric, model), ("setup", fabric, other)]
    steps = recorder.calls[2:]
    assert [c[0] for c in steps] == ["step", "step"]
    assert all(c[1] is fabric.strategy and c[2] is optimizer.optimizer for c in steps)


def test_call_passes_each_callback_only_the_keywords_it_takes_and_warns_on_a_non_callable():
    recorder = Recorder()

    class Takes_everything:
        def __init__(self):
            self.got = None

        def on_epoch_end(self, **kwargs):
            self.got = kwargs

    class NotAHook:
        on_epoch_end = 3

    everything = Takes_everything()
    fabric = Fabric(accelerator="cpu", callbacks=[recorder, everything, NotAHook()])
    with pytest.warns(UserWarning, match="Skipping the callback `NotAHook.on_epoch_end` because it is not callable"):
        fabric.call("on_epoch_end", results=1, epoch=4)
    assert recorder.calls == [("epoch", 1)] and everything.got == {"results": 1, "epoch": 4}


@pytest.mark.parametrize("precision", ["64-true", "bf16-true", "16-true"])
def test_complex_buffers_stay_complex_under_every_true_precision(precision):
    class Rope(Net):
        def __init__(self):
            super().__init__()
            self.register_buffer("freqs", torch.polar(torch.ones(3), torch.tensor([0.1, 0.2, 0.3])))
            self.register_buffer("steps", torch.arange(3))

    net = Rope()
    freqs = net.freqs.clone()
    fabric = Fabric(accelerator="cpu", precision=precision)  # bf16 warns where the CPU emulates it: not this test's
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns when a cast drops the imaginary part
        model = fabric.setup(net)
    assert torch.equal(model.module.freqs, freqs) and model.module.steps.dtype == torch.int64
    assert model.module.layer.weight.dtype == {"64-true": torch.float64, "bf16-true": torch.bfloat16}.get(
        precision, torch.float16
    )


def test_dp_on_a_cpu_warns_and_runs_ddp():
    with pytest.warns(UserWarning, match="strategy='dp'.*uses strategy='ddp'"):
        fabric = Fabric(accelerator="cpu", devices=2, strategy="dp")
    assert isinstance(fabric.strategy, DDPStrategy)


@pytest.mark.gpu
def test_dp_on_cuda_wraps_the_model_in_data_parallel():
    fabric = Fabric(accelerator="cuda", devices=1, strategy="dp")
    model = fabric.setup(Net())
    assert isinstance(model._forward_module, nn.DataParallel)
    assert model(torch.ones(4, 2, device=fabric.device)).shape == (4, 2)


LIGHTNING_MODULE_CHECKS = [
    "the module knows its Fabric",
    "self.optimizers() is the optimizer setup returned",
    "self.log and self.log_dict reach the loggers",
    "the logged loss is the step's loss",
    "the module hears the Fabric's hooks",
]


@pytest.mark.parametrize("package", ["lightning", "pytorch_lightning"])
def test_a_lightning_module_logs_through_fabric(package):
    if find_spec(package) is None:  # not imported here: importing Lightning patches torch.compile process-wide
        pytest.skip(f"{package} is not installed (the 'lightning' extra)")
    out = run_python(str(SCRIPTS / "lightning_module.py"), package, timeout=180).stdout
    assert_passed(out, LIGHTNING_MODULE_CHECKS, ranks=("0",))


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_a_fabric_subclass_run_method_launches_the_processes_first(strategy):
    """Lightning's older pattern: `class Trainer(Fabric): def run(self, ...)`, then `Trainer(devices=2).run(...)`."""
    out = run_python(str(SCRIPTS / "legacy_api.py"), strategy, timeout=240).stdout
    assert_passed(out, ["run of a Fabric subclass launched"])
    assert "DONE result=14.0" in out


def test_the_base_run_does_nothing_and_sharded_model_is_deprecated_for_init_module():
    fabric = Fabric(accelerator="cpu")
    assert fabric.run(1, x=2) is None
    with pytest.warns(DeprecationWarning, match="deprecated in favor of `Fabric.init_module\\(\\)`"):
        with fabric.sharded_model():
            layer = nn.Linear(2, 2)
    assert layer.weight.abs().sum() > 0  # initialised as usual


def test_fsdp_takes_lightnings_sharding_strategy_names():
    from torch.distributed.fsdp import ShardingStrategy

    from fabriclite.strategies import FSDPStrategy

    assert FSDPStrategy(sharding_strategy="FULL_SHARD").reshard_after_forward is True
    assert FSDPStrategy(sharding_strategy=ShardingStrategy.SHARD_GRAD_OP).reshard_after_forward is False
    assert FSDPStrategy(sharding_strategy="NO_SHARD").mesh_kind == "replicate"
    assert FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 4)).mesh_kind == "hybrid"
    with pytest.raises(ValueError, match="reshard_after_forward=False was also given"):
        FSDPStrategy(sharding_strategy="FULL_SHARD", reshard_after_forward=False)
    with pytest.raises(ValueError, match="sharding_strategy='ZERO3' is not supported. Valid: 'FULL_SHARD'"):
        FSDPStrategy(sharding_strategy="ZERO3")
    with pytest.raises(ValueError, match="device_mesh=\\(2, 2\\) is for hybrid sharding"):
        FSDPStrategy(sharding_strategy="FULL_SHARD", device_mesh=(2, 2))
    with pytest.raises(ValueError, match="must be \\(replicate, shard\\): two ints >= 1"):
        FSDPStrategy(sharding_strategy="HYBRID_SHARD", device_mesh=(2, 0))
