import os
import subprocess
import sys

import pytest
import torch

from fabriclite import Fabric, seed_everything
from fabriclite.accelerators import CPUAccelerator
from fabriclite.strategies import SingleDeviceStrategy


def test_one_device_has_the_single_process_layout():
    fabric = Fabric(accelerator="cpu")
    assert fabric.device == torch.device("cpu")
    assert (fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size) == (0, 0, 0, 1)
    assert fabric.is_global_zero
    assert isinstance(fabric.strategy, SingleDeviceStrategy)
    assert isinstance(fabric.accelerator, CPUAccelerator)
    assert fabric.logger is None and fabric.loggers == []


def test_auto_accelerator_picks_the_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert Fabric().device.type == "cpu"


def test_launch_runs_the_function_with_the_fabric_first():
    fabric = Fabric(accelerator="cpu")
    assert fabric.launch(lambda f, a, b=0: (f, a, b), 1, b=2) == (fabric, 1, 2)
    assert fabric.launch() is None
    with pytest.raises(TypeError, match="callable"):
        fabric.launch("train")


def test_print_prints_on_rank_zero(capsys):
    Fabric(accelerator="cpu").print("hello", 3)
    assert capsys.readouterr().out == "hello 3\n"


def test_to_device_moves_nested_collections_and_modules():
    fabric = Fabric(accelerator="cpu")
    data = {"a": [torch.ones(1), (torch.zeros(2), "text")], "b": 3}
    moved = fabric.to_device(data)
    assert moved["a"][1][1] == "text" and moved["b"] == 3
    assert moved["a"][0].device.type == "cpu"
    module = torch.nn.Linear(2, 2)
    assert fabric.to_device(module) is module


def test_collectives_on_one_process_return_the_data_as_tensors():
    fabric = Fabric(accelerator="cpu")
    fabric.barrier()
    assert fabric.broadcast({"x": 1}) == {"x": 1}
    gathered = fabric.all_gather({"loss": 2.0, "t": torch.arange(3)})
    assert torch.equal(gathered["loss"], torch.tensor(2.0)) and torch.equal(gathered["t"], torch.arange(3))
    assert torch.equal(fabric.all_reduce(torch.tensor([1.0, 3.0]), reduce_op="sum"), torch.tensor([1.0, 3.0]))
    with pytest.raises(ValueError, match="reduce_op='median'"):
        fabric.all_reduce(torch.tensor(1.0), reduce_op="median")


def test_rank_zero_first_runs_the_block():
    ran = []
    with Fabric(accelerator="cpu").rank_zero_first():
        ran.append(True)
    assert ran == [True]


class RecordingLogger:
    def __init__(self):
        self.calls = []

    def log_metrics(self, metrics, step=None):
        self.calls.append((metrics, step))


def test_log_and_log_dict_send_python_numbers_to_every_logger():
    first, second = RecordingLogger(), RecordingLogger()
    fabric = Fabric(accelerator="cpu", loggers=[first, second])
    assert fabric.logger is first
    fabric.log("loss", torch.tensor(0.5), step=3)
    fabric.log_dict({"acc": torch.tensor([0.25]), "lr": 0.1})
    assert first.calls == second.calls == [({"loss": 0.5}, 3), ({"acc": 0.25, "lr": 0.1}, None)]
    assert type(first.calls[0][0]["loss"]) is float
    with pytest.raises(ValueError, match="one-element"):
        fabric.log("bad", torch.ones(3))


def test_a_single_logger_is_accepted_without_a_list():
    logger = RecordingLogger()
    assert Fabric(accelerator="cpu", loggers=logger).loggers == [logger]


def test_call_runs_the_hook_on_every_callback_that_has_it():
    seen = []

    class A:
        def on_epoch_end(self, value):
            seen.append(("a", value))

    class B:
        pass

    fabric = Fabric(accelerator="cpu", callbacks=[A(), B()])
    fabric.call("on_epoch_end", value=4)
    fabric.call("on_nothing")
    assert seen == [("a", 4)]


def test_seed_everything_makes_draws_repeat_and_returns_the_seed(monkeypatch):
    assert seed_everything(11, verbose=False) == 11
    first = torch.rand(3)
    assert Fabric.seed_everything(11, verbose=False) == 11
    assert torch.equal(torch.rand(3), first)
    monkeypatch.setenv("PL_GLOBAL_SEED", "5")
    assert seed_everything(verbose=False) == 5


@pytest.mark.parametrize("seed", [-1, 2**32, "seven", True])  # "7" and 1.5 are converted, as Lightning does
def test_seed_everything_refuses_invalid_seeds(seed):
    with pytest.raises(ValueError, match="seed="):
        seed_everything(seed)


def test_importing_fabriclite_keeps_heavy_and_optional_modules_out():
    code = (
        "import sys, fabriclite, fabriclite.kernels\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in {'tensorboard', 'triton', 'sklearn', 'yaml', 'lightning'}"
        " or m.startswith(('torch.distributed.fsdp', 'torch.distributed.checkpoint', 'torch._inductor'))]\n"
        "print(sorted(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_kernels_on_a_device_without_triton_leave_the_model_unchanged_and_say_so(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.warns(UserWarning, match="kernels=True"):
        fabric = Fabric(accelerator="cpu", kernels=True)
    model = fabric.setup(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)))
    assert type(model.module[1]) is torch.nn.LayerNorm


def test_kernels_swap_layer_norms_when_triton_can_run(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fabric = Fabric(accelerator="cpu", kernels=True)
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    keys = list(net.state_dict())
    model = fabric.setup(net)
    assert type(model.module[1]) is not torch.nn.LayerNorm
    assert list(model.state_dict()) == keys


@pytest.mark.parametrize("call", ["barrier", "broadcast", "all_gather", "all_reduce"])
def test_collectives_before_launch_are_refused_under_a_launcher(call):
    fabric = Fabric(accelerator="cpu", devices=2)
    args = {"barrier": (), "broadcast": (1,), "all_gather": (torch.ones(1),), "all_reduce": (torch.ones(1),)}[call]
    with pytest.raises(RuntimeError, match="before fabric.launch"):
        getattr(fabric, call)(*args)


def test_importing_fabriclite_adds_no_top_level_package_but_itself_to_what_torch_imports():
    # Every package a bare `import fabriclite` loads beyond torch's costs import time (secrets pulled in hmac once).
    code = (
        "import sys; import torch; before = set(sys.modules); import fabriclite; "
        "print(sorted({m.split('.')[0] for m in set(sys.modules) - before}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['fabriclite']"


def test_loggers_are_called_by_keyword_as_lightning_does_so_keyword_only_loggers_and_mocks_work():
    from unittest import mock

    from fabriclite.loggers import Logger

    class KeywordOnly(Logger):
        name, version = "keywords", 0

        def __init__(self):
            self.calls = []

        def log_metrics(self, *, metrics, step=None):
            self.calls.append((metrics, step))

        def log_hyperparams(self, *, params):
            pass

    keyword_only, mocked = KeywordOnly(), mock.Mock()
    fabric = Fabric(accelerator="cpu", loggers=[keyword_only, mocked])
    fabric.log("loss", torch.tensor(0.5), step=3)
    fabric.log_dict({"acc": 1.0})
    assert keyword_only.calls == [({"loss": 0.5}, 3), ({"acc": 1.0}, None)]
    assert mocked.log_metrics.call_args_list == [
        mock.call(metrics={"loss": 0.5}, step=3),
        mock.call(metrics={"acc": 1.0}, step=None),
    ]
