import argparse
import csv
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from fabriclite.loggers import CSVLogger
from helpers import run_on_small_disk, run_python


def read_rows(logger):
    with open(os.path.join(logger.log_dir, "metrics.csv"), newline="") as file:
        return list(csv.DictReader(file))


def test_logs_go_to_root_dir_name_version_folder(tmp_path):
    logger = CSVLogger(tmp_path, name="exp")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert logger.root_dir == str(tmp_path)  # the argument as given, as in Lightning
    assert logger.log_dir == str(tmp_path / "exp" / "version_0")
    assert (tmp_path / "exp" / "version_0" / "metrics.csv").is_file()


def test_version_auto_increments_past_the_highest_existing_version_folder(tmp_path):
    for folder in ("version_0", "version_3", "version_x", "other"):
        (tmp_path / "lightning_logs" / folder).mkdir(parents=True)
    logger = CSVLogger(tmp_path)
    assert logger.version == 4
    assert logger.log_dir == str(tmp_path / "lightning_logs" / "version_4")


def test_consecutive_runs_get_consecutive_versions(tmp_path):
    versions = []
    for _ in range(3):
        logger = CSVLogger(tmp_path)
        logger.log_metrics({"loss": 1.0})
        logger.finalize("success")
        versions.append(logger.version)
    assert versions == [0, 1, 2]


def test_a_str_version_is_used_as_the_folder_name_as_is(tmp_path):
    logger = CSVLogger(tmp_path, name="exp", version="run-a")
    assert logger.log_dir == str(tmp_path / "exp" / "run-a")


def test_an_int_version_names_the_folder_version_n(tmp_path):
    assert CSVLogger(tmp_path, version=7).log_dir == str(tmp_path / "lightning_logs" / "version_7")


def test_an_empty_name_puts_versions_directly_under_root_dir(tmp_path):
    logger = CSVLogger(tmp_path, name="")
    assert logger.root_dir == str(tmp_path)
    assert logger.log_dir == str(tmp_path / "version_0")


def second_run_in_version_0(tmp_path):
    first = CSVLogger(tmp_path, version=0)
    first.log_metrics({"old": 1.0}, step=0)
    first.finalize("success")
    return CSVLogger(tmp_path, version=0)


def test_reusing_a_version_folder_replaces_its_metrics_csv_with_a_warning_at_the_first_row(tmp_path):
    second = second_run_in_version_0(tmp_path)
    with pytest.warns(UserWarning, match="Experiment logs directory .* exists and is not empty.*version=None"):
        second.log_metrics({"new": 2.0}, step=0)
    second.finalize("success")
    assert read_rows(second) == [{"step": "0", "new": "2.0"}]


def test_the_overwrite_warning_comes_at_experiment_as_in_lightning_but_the_old_file_stays_until_a_write(tmp_path):
    second = second_run_in_version_0(tmp_path)
    with pytest.warns(UserWarning, match="Experiment logs directory .* exists and is not empty"):
        _ = second.experiment
    second.finalize("success")  # nothing logged: the earlier run's rows are still there (Lightning deletes them)
    assert read_rows(second) == [{"step": "0", "old": "1.0"}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once per logger
        second.log_metrics({"new": 2.0}, step=0)
    second.finalize("success")
    assert read_rows(second) == [{"step": "0", "new": "2.0"}]


def test_header_grows_when_new_metric_names_appear_and_old_rows_are_kept(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_metrics({"loss": 0.5, "acc": 0.75}, step=1)
    logger.log_metrics({"val_loss": 0.25}, step=2)
    logger.finalize("success")
    rows = read_rows(logger)
    assert set(rows[0]) == {"step", "loss", "acc", "val_loss"}
    assert rows == [
        {"step": "0", "loss": "1.0", "acc": "", "val_loss": ""},
        {"step": "1", "loss": "0.5", "acc": "0.75", "val_loss": ""},
        {"step": "2", "loss": "", "acc": "", "val_loss": "0.25"},
    ]


def test_rows_are_buffered_until_flush_logs_every_n_steps(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=3)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.log_metrics({"loss": 2.0}, step=1)
    assert not os.path.exists(os.path.join(logger.log_dir, "metrics.csv"))
    logger.log_metrics({"loss": 3.0}, step=2)
    assert [row["loss"] for row in read_rows(logger)] == ["1.0", "2.0", "3.0"]


def test_finalize_flushes_the_buffered_rows(tmp_path):
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=100)
    for step in range(5):
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.finalize("success")
    assert [row["step"] for row in read_rows(logger)] == ["0", "1", "2", "3", "4"]


def test_save_flushes_and_later_rows_are_appended(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.save()
    logger.log_metrics({"loss": 2.0}, step=1)
    logger.save()
    assert [row["loss"] for row in read_rows(logger)] == ["1.0", "2.0"]


def test_rows_reach_disk_when_a_script_exits_without_calling_finalize(tmp_path):
    script = textwrap.dedent(
        f"""
        from fabriclite.loggers import CSVLogger
        logger = CSVLogger({str(tmp_path)!r})
        for step in range(3):
            logger.log_metrics({{"loss": step * 0.5}}, step=step)
        """
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    subprocess.run([sys.executable, "-c", script], check=True, env=env, timeout=120)
    with open(tmp_path / "lightning_logs" / "version_0" / "metrics.csv", newline="") as file:
        assert [row["loss"] for row in csv.DictReader(file)] == ["0.0", "0.5", "1.0"]


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
def test_step_defaults_to_the_rows_not_yet_written_and_the_columns_are_sorted_as_lightnings(root, tmp_path):
    loggers = pytest.importorskip(root + ".loggers")
    logger = loggers.CSVLogger(tmp_path, flush_logs_every_n_steps=2)
    for value in range(5):
        logger.log_metrics({"zeta": float(value), "alpha": 1.0})
    logger.log_metrics({"beta": 2.0}, step=7)
    logger.finalize("success")
    with open(os.path.join(logger.log_dir, "metrics.csv"), newline="") as file:
        header = file.readline().strip()
    assert header == "alpha,beta,step,zeta"
    assert [row["step"] for row in read_rows(logger)] == ["0", "1", "0", "1", "0", "7"]


def test_prefix_is_joined_to_metric_names_with_a_dash(tmp_path):
    logger = CSVLogger(tmp_path, prefix="train")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert "train-loss" in read_rows(logger)[0]


def test_zero_dim_tensors_are_logged_as_numbers(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"loss": torch.tensor(0.5), "count": torch.tensor(3)}, step=torch.tensor(9))
    logger.finalize("success")
    assert read_rows(logger) == [{"step": "9", "loss": "0.5", "count": "3"}]


def test_hparams_yaml_round_trips_through_safe_load(tmp_path):
    logger = CSVLogger(tmp_path)
    params = {
        "lr": 1e-3,
        "layers": [64, 32],
        "optim": {"name": "adam", "betas": (0.9, 0.99)},
        "path": Path("/x"),
    }
    logger.log_hyperparams(params)
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as file:
        loaded = yaml.safe_load(file)
    assert loaded == {
        "lr": 1e-3,
        "layers": [64, 32],
        "optim": {"name": "adam", "betas": [0.9, 0.99]},
        "path": "/x",
    }


def test_hparams_accept_an_argparse_namespace_and_merge_across_calls(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.log_hyperparams(argparse.Namespace(lr=0.1, epochs=3))
    logger.log_hyperparams({"epochs": 5, "seed": 1})
    with open(os.path.join(logger.log_dir, "hparams.yaml")) as file:
        assert yaml.safe_load(file) == {"lr": 0.1, "epochs": 5, "seed": 1}


@pytest.mark.parametrize("value", [0, -1, 2.5, True])
def test_flush_logs_every_n_steps_below_one_or_not_an_int_is_rejected(tmp_path, value):
    with pytest.raises(ValueError, match=rf"flush_logs_every_n_steps={value!r}.*int >= 1"):
        CSVLogger(tmp_path, flush_logs_every_n_steps=value)


@pytest.mark.parametrize("version", [-1, "", 1.5])
def test_an_invalid_version_is_rejected(tmp_path, version):
    with pytest.raises(ValueError, match="version="):
        CSVLogger(tmp_path, version=version)


def test_metrics_that_are_not_a_mapping_are_rejected(tmp_path):
    with pytest.raises(TypeError, match="metrics must be a mapping.*list"):
        CSVLogger(tmp_path).log_metrics([("loss", 1.0)])


def test_a_metric_that_is_not_a_number_is_rejected_by_name(tmp_path):
    with pytest.raises(TypeError, match="'name'.*str"):
        CSVLogger(tmp_path).log_metrics({"name": "abc"})


def test_a_tensor_metric_with_several_elements_is_rejected_by_name(tmp_path):
    with pytest.raises(ValueError, match="'loss'.*single number"):
        CSVLogger(tmp_path).log_metrics({"loss": torch.ones(3)})


def test_params_that_are_not_a_dict_or_namespace_are_rejected(tmp_path):
    with pytest.raises(TypeError, match="params must be a dict or an argparse.Namespace"):
        CSVLogger(tmp_path).log_hyperparams(["lr", 0.1])


def test_experiment_is_the_metrics_writer_as_in_lightning(tmp_path):
    logger = CSVLogger(tmp_path, prefix="train")
    writer = logger.experiment
    assert os.path.isdir(writer.log_dir)  # files can go next to metrics.csv, as in Lightning
    writer.log_metrics({"loss": torch.tensor(0.5)}, step=2)  # as it is: no prefix
    logger.log_metrics({"loss": 0.25}, step=3)
    assert writer.metrics == [{"loss": 0.5, "step": 2}, {"train-loss": 0.25, "step": 3}]
    writer.save()
    assert writer.metrics == [] and writer.log_dir == logger.log_dir
    with open(writer.metrics_file_path, newline="") as file:
        rows = list(csv.DictReader(file))
    assert [(row["step"], row["loss"], row["train-loss"]) for row in rows] == [("2", "0.5", ""), ("3", "", "0.25")]


def test_variables_in_root_dir_are_not_expanded_as_in_lightning(tmp_path, monkeypatch):
    # Lightning's CSVLogger, unlike its TensorBoardLogger, takes the path as it is.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("FABRICLITE_TEST_LOGS", str(tmp_path / "expanded"))
    logger = CSVLogger("$FABRICLITE_TEST_LOGS", name="exp")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert logger.log_dir == os.path.join("$FABRICLITE_TEST_LOGS", "exp", "version_0")
    assert (tmp_path / "$FABRICLITE_TEST_LOGS" / "exp" / "version_0" / "metrics.csv").is_file()


def test_a_file_where_the_folder_should_be_raises_at_the_first_row_naming_it(tmp_path):
    (tmp_path / "logs").write_text("not a folder")
    logger = CSVLogger(tmp_path / "logs", name="run")
    with pytest.raises(OSError, match=r"CSVLogger cannot write into .*logs.run.version_0: a file is where a folder"):
        logger.log_metrics({"loss": 1.0}, step=0)


def test_a_full_disk_raises_naming_the_file_and_the_rows_are_written_once_space_is_freed(tmp_path):
    result = run_on_small_disk(tmp_path, "1m", "logger_disk_full.py")
    assert "PASS disk full" in result.stdout, result.stdout + result.stderr


EXIT_WITHOUT_FINALIZE = """
import os, shutil, sys
from fabriclite.loggers import CSVLogger
logger = CSVLogger(sys.argv[1], name="run", version=0)
for step in range(5):
    logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
if sys.argv[2] == "break":  # the folder becomes a file before the rows reach the disk
    shutil.rmtree(logger.log_dir)
    open(logger.log_dir, "w").close()
"""


def test_rows_not_yet_written_reach_the_disk_when_the_script_ends_without_finalize(tmp_path):
    run_python("-c", EXIT_WITHOUT_FINALIZE, str(tmp_path), "keep", timeout=120)
    lines = (tmp_path / "run" / "version_0" / "metrics.csv").read_text().splitlines()
    assert lines[0] == "loss,step" and len(lines) == 6


def test_rows_that_cannot_be_written_at_exit_are_reported_with_the_file_not_dropped_in_silence(tmp_path):
    result = run_python("-c", EXIT_WITHOUT_FINALIZE, str(tmp_path), "break", timeout=120, check=False)
    assert "fabriclite: CSVLogger could not write 5 rows to" in result.stderr, result.stderr
    assert "metrics.csv" in result.stderr and "these rows are lost" in result.stderr
    assert "Exception ignored" not in result.stderr
