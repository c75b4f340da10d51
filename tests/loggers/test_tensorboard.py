import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fabriclite.loggers import TensorBoardLogger

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2


def read_events(folder):
    accumulator = EventAccumulator(str(folder))
    accumulator.Reload()
    return accumulator


def test_event_file_is_written_under_root_dir_name_version_and_scalars_read_back(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="exp")
    logger.log_metrics({"loss": 0.5, "acc": torch.tensor(0.75)}, step=3)
    logger.log_metrics({"loss": 0.25}, step=4)
    logger.finalize("success")
    assert logger.log_dir == str(tmp_path / "exp" / "version_0")
    events = read_events(logger.log_dir)
    assert [(event.step, event.value) for event in events.Scalars("loss")] == [(3, 0.5), (4, 0.25)]
    assert [(event.step, event.value) for event in events.Scalars("acc")] == [(3, 0.75)]


def test_version_auto_increments_past_existing_version_folders(tmp_path):
    (tmp_path / "lightning_logs" / "version_0").mkdir(parents=True)
    (tmp_path / "lightning_logs" / "version_1").mkdir()
    logger = TensorBoardLogger(tmp_path)
    assert logger.version == 2
    assert logger.root_dir == str(tmp_path)  # the argument as given, as in Lightning


def test_sub_dir_is_appended_to_the_version_folder(tmp_path):
    logger = TensorBoardLogger(tmp_path, version="run", sub_dir="train")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert logger.log_dir == str(tmp_path / "lightning_logs" / "run" / "train")
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(logger.log_dir))


def test_writer_is_created_on_first_use_not_at_construction(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    assert not (tmp_path / "lightning_logs").exists()
    assert logger.experiment is logger.experiment
    assert type(logger.experiment).__name__ == "SummaryWriter"
    assert logger.experiment.log_dir == logger.log_dir
    logger.finalize("success")


def test_extra_kwargs_are_passed_to_the_summary_writer(tmp_path):
    logger = TensorBoardLogger(tmp_path, filename_suffix=".mine")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert any(name.endswith(".mine") for name in os.listdir(logger.log_dir))


def test_prefix_is_joined_to_metric_names_with_a_dash(tmp_path):
    logger = TensorBoardLogger(tmp_path, prefix="train")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert read_events(logger.log_dir).Tags()["scalars"] == ["train-loss"]


def read_hparams(events):
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams
    return {
        key: value.WhichOneof("kind") and getattr(value, value.WhichOneof("kind")) for key, value in hparams.items()
    }


def test_hyperparams_are_flattened_into_the_runs_own_event_file(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1, "optim": {"name": "adam"}, "layers": [1, 2], "flag": True})
    logger.finalize("success")
    assert os.listdir(logger.log_dir)[0].startswith("events.out.tfevents")
    assert len(os.listdir(logger.log_dir)) == 1
    hparams = read_hparams(read_events(logger.log_dir))
    assert hparams == {"lr": 0.1, "optim/name": "adam", "layers": "[1, 2]", "flag": True}


def test_hyperparams_without_metrics_log_the_default_hp_metric(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1})
    logger.finalize("success")
    events = read_events(logger.log_dir)
    assert [(event.step, event.value) for event in events.Scalars("hp_metric")] == [(0, -1.0)]


def test_hyperparams_with_default_hp_metric_off_log_no_scalar(tmp_path):
    logger = TensorBoardLogger(tmp_path, default_hp_metric=False)
    logger.log_hyperparams({"lr": 0.1})
    logger.finalize("success")
    assert read_events(logger.log_dir).Tags()["scalars"] == []


def test_hyperparams_with_metrics_log_those_metrics_at_step_zero(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1}, metrics={"val_acc": 0.5})
    logger.finalize("success")
    events = read_events(logger.log_dir)
    assert events.Tags()["scalars"] == ["val_acc"]
    assert [(event.step, event.value) for event in events.Scalars("val_acc")] == [(0, 0.5)]


def test_logging_after_finalize_opens_a_new_writer(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    logger.log_metrics({"loss": 2.0}, step=1)
    logger.finalize("success")
    # Two event files whose names TensorBoard may sort either way: compare the points, not their order.
    points = sorted((event.step, event.value) for event in read_events(logger.log_dir).Scalars("loss"))
    assert points == [(0, 1.0), (1, 2.0)]


def test_logger_pickles_without_its_writer(tmp_path):
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"loss": 1.0}, step=0)
    clone = pickle.loads(pickle.dumps(logger))
    assert clone._experiment is None
    assert clone.log_dir == logger.log_dir
    logger.finalize("success")


def test_metrics_that_are_not_a_mapping_are_rejected(tmp_path):
    with pytest.raises(TypeError, match="metrics must be a mapping.*float"):
        TensorBoardLogger(tmp_path).log_metrics(0.5)


def test_missing_tensorboard_raises_at_construction_with_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ModuleNotFoundError, match=r'pip install "fabriclite\[tensorboard\]"'):
        TensorBoardLogger(tmp_path)


def test_importing_fabriclite_loggers_imports_neither_tensorboard_nor_yaml():
    code = (
        "import sys, fabriclite.loggers; "
        "print(sorted(m for m in ('tensorboard', 'torch.utils.tensorboard', 'yaml') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, check=True
    )
    assert result.stdout.strip() == "[]"


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 2)

    def forward(self, x):
        return self.fc(x).relu()


# add_graph traces with torch.jit, which torch now marks deprecated; that is torch's warning, not the logger's.
tracing = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")


def graph_nodes(folder):
    """``{node name: op}`` of the graph in the event file, the names scoped by the traced module's class."""
    return {node.name: node.op for node in read_events(folder).Graph().node}


@tracing
def test_log_graph_writes_the_users_module_when_given_the_fabric_wrapped_or_compiled_model(tmp_path):
    from fabriclite import Fabric

    model = Fabric(accelerator="cpu").setup(Tiny())
    for version, given in enumerate([model, torch.compile(model)]):  # compiled, never run: nothing is compiled
        logger = TensorBoardLogger(tmp_path, version=version)
        logger.log_graph(given, torch.randn(1, 3))
        logger.finalize("success")
        nodes = graph_nodes(logger.log_dir)
        assert nodes["Tiny/Linear[fc]/weight/weight"] == "prim::GetAttr", nodes
        assert sorted(op for op in nodes.values() if op.startswith("aten::")) == ["aten::linear", "aten::relu"]


@tracing
def test_log_graph_uses_example_input_array_and_warns_without_a_usable_input(tmp_path):
    net = Tiny()
    logger = TensorBoardLogger(tmp_path)
    # Lightning's words, which warning filters and tests written for it match
    with pytest.warns(UserWarning, match="The `model.example_input_array` attribute is not set or `input_array` was"):
        logger.log_graph(net)
    with pytest.warns(UserWarning, match="has type <class 'list'> which can't be traced by TensorBoard"):
        logger.log_graph(net, [torch.randn(1, 3)])
    assert not os.path.exists(logger.log_dir)  # nothing was written, not even an empty event file
    net.example_input_array = torch.randn(2, 3)
    logger.log_graph(net)
    logger.finalize("success")
    assert "aten::linear" in graph_nodes(logger.log_dir).values()


class WithBatchHooks(Tiny):
    """The two batch hooks Lightning calls on a LightningModule's input before tracing it."""

    def _on_before_batch_transfer(self, batch):
        return batch[:, :3]

    def _apply_batch_transfer_handler(self, batch):
        self.handled = tuple(batch.shape)
        return batch.to(self.fc.weight.device)


@tracing
def test_log_graph_passes_a_lightning_modules_input_through_its_batch_hooks(tmp_path):
    net = WithBatchHooks()
    logger = TensorBoardLogger(tmp_path)
    logger.log_graph(net, torch.randn(1, 5))  # five columns: only the hook makes it fit Linear(3, 2)
    logger.finalize("success")
    assert net.handled == (1, 3)
    assert "aten::relu" in graph_nodes(logger.log_dir).values()


def test_variables_and_home_in_the_path_are_expanded_as_in_lightning(tmp_path, monkeypatch):
    monkeypatch.setenv("FABRICLITE_TEST_LOGS", str(tmp_path / "scratch"))
    monkeypatch.setenv("FABRICLITE_TEST_JOB", "17")
    (tmp_path / "scratch" / "runs" / "job_17" / "version_0").mkdir(parents=True)
    logger = TensorBoardLogger(
        "$FABRICLITE_TEST_LOGS/runs", name="job_$FABRICLITE_TEST_JOB", sub_dir="${FABRICLITE_TEST_JOB}"
    )
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    # version_1: the version_0 already in the expanded folder counts
    assert logger.log_dir == str(tmp_path / "scratch" / "runs" / "job_17" / "version_1" / "17")
    assert read_events(logger.log_dir).Scalars("loss")[0].value == 1.0
    monkeypatch.setenv("HOME", str(tmp_path))
    logger = TensorBoardLogger("~/tb", version="v$FABRICLITE_TEST_JOB")
    assert logger.log_dir == str(tmp_path / "tb" / "lightning_logs" / "v17")
    assert logger.root_dir == "~/tb"  # the argument as given, as in Lightning


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
@pytest.mark.parametrize("kind", ["CSVLogger", "TensorBoardLogger"])
def test_root_dir_is_the_argument_as_given_and_log_dir_the_folder_written(root, kind, tmp_path, monkeypatch):
    import importlib

    if root != "fabriclite":
        pytest.importorskip(root)
    monkeypatch.chdir(tmp_path)
    logger = getattr(importlib.import_module(root + ".loggers"), kind)("logs", name="exp")
    assert logger.root_dir == "logs"  # code joining root_dir and name finds the experiment, as under Lightning
    assert logger.log_dir == os.path.join("logs", "exp", "version_0")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert (tmp_path / "logs" / "exp" / "version_0").is_dir()


def test_a_file_where_the_folder_should_be_raises_at_the_first_log_naming_it(tmp_path):
    (tmp_path / "tb").write_text("not a folder")
    logger = TensorBoardLogger(tmp_path / "tb", name="run")
    with pytest.raises(OSError, match=r"TensorBoardLogger cannot write into .*tb.run.version_0: a file is where"):
        logger.log_metrics({"loss": 1.0}, step=0)


def test_what_a_script_wrote_last_reaches_the_file_without_finalize(tmp_path):
    # Lightning's examples never call finalize(); the writer's thread flushes only every flush_secs (120 s).
    from helpers import run_python

    code = (
        "from fabriclite.loggers import TensorBoardLogger\n"
        f"logger = TensorBoardLogger({str(tmp_path)!r}, name='exp')\n"
        "logger.log_metrics({'loss': 0.5}, step=1)\n"
        "logger.experiment.add_scalar('Test/reward', 50.0, 0)\n"
    )
    run_python("-c", code, timeout=120)
    events = read_events(tmp_path / "exp" / "version_0")
    assert [(e.step, e.value) for e in events.Scalars("Test/reward")] == [(0, 50.0)]
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 0.5)]
