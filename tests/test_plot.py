"""`fabriclite plot`: the runs it finds, the numbers it draws, the image it writes, and its errors.

The logs are written by the real CSVLogger. What is drawn is checked in this process through `_collect_runs` and
`_draw`; the command itself runs once through `run_python`, as a user runs it.
"""

import pytest

from fabriclite.cli import main
from fabriclite.loggers import CSVLogger
from fabriclite.plot import _choose_metrics, _collect_runs, _draw, plot_runs
from helpers import run_python

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def logs(tmp_path):
    """Two runs with different metrics, steps and gaps: logs/gpt/version_0 and logs/bert/version_0."""
    gpt = CSVLogger(tmp_path / "logs", name="gpt")
    for step in range(4):
        gpt.log_metrics({"loss": 4.0 - step}, step=step)
        if step % 2:
            gpt.log_metrics({"accuracy": step / 10}, step=step)  # a row of its own: the loss cell stays empty
    gpt.finalize("success")
    bert = CSVLogger(tmp_path / "logs", name="bert")
    bert.log_metrics({"loss": 9.0}, step=0)
    bert.log_metrics({"loss": 7.0, "throughput": 120.0}, step=10)
    bert.log_metrics({"throughput": 130.0}, step=20)
    bert.finalize("success")
    return tmp_path / "logs"


GPT = {"loss": ([0, 1, 2, 3], [4.0, 3.0, 2.0, 1.0]), "accuracy": ([1, 3], [0.1, 0.3])}
BERT = {"loss": ([0, 10], [9.0, 7.0]), "throughput": ([10, 20], [120.0, 130.0])}


def fails_with(capsys, *argv):
    """Run `fabriclite <argv>` in this process, expect the usage error exit (2), return stderr."""
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    assert exit_info.value.code == 2
    return capsys.readouterr().err


# ---------------------------------------------------------------- what is read
def test_every_metrics_csv_below_a_folder_is_a_run_labelled_by_its_path_below_the_common_parent(logs):
    assert _collect_runs([logs]) == {"bert/version_0": BERT, "gpt/version_0": GPT}


def test_a_metrics_csv_file_and_a_version_folder_are_runs_and_a_run_given_twice_is_read_once(logs):
    runs = _collect_runs([logs / "gpt" / "version_0" / "metrics.csv", logs / "bert" / "version_0", logs / "gpt"])
    assert runs == {"gpt/version_0": GPT, "bert/version_0": BERT}
    assert _collect_runs([logs / "gpt" / "version_0"]) == {"version_0": GPT}


def test_runs_of_one_experiment_are_labelled_by_version(logs):
    second = CSVLogger(logs, name="gpt")
    second.log_metrics({"loss": 0.5}, step=0)
    second.finalize("success")
    assert _collect_runs([logs / "gpt"]) == {"version_0": GPT, "version_1": {"loss": ([0], [0.5])}}


def test_text_columns_are_ignored_and_empty_or_nan_cells_are_skipped(tmp_path):
    path = tmp_path / "run" / "metrics.csv"
    path.parent.mkdir()
    path.write_text("step,loss,note,lr\n0,1.5,warmup,\n1,nan,ok,0.1\n,2.0,,0.2\n2,0.5,,0.3\n")
    assert _collect_runs([path]) == {"run": {"loss": ([0, 2], [1.5, 0.5]), "lr": ([1, 2], [0.1, 0.3])}}


def test_another_logged_column_can_be_the_x_axis_and_step_is_never_a_metric(logs):
    assert _collect_runs([logs / "bert"], x="throughput") == {"version_0": {"loss": ([120.0], [7.0])}}


def test_metrics_default_to_every_metric_in_order_of_appearance_or_are_the_ones_named(logs):
    runs = _collect_runs([logs])
    assert _choose_metrics(runs, None) == ["loss", "throughput", "accuracy"]
    assert _choose_metrics(runs, ["throughput", "loss"]) == ["throughput", "loss"]


# ---------------------------------------------------------------- what is drawn
def test_each_metric_gets_a_subplot_with_one_line_per_run_that_logged_it(logs):
    runs = _collect_runs([logs])
    figure = _draw(runs, ["loss", "accuracy"], "step")
    shown = [ax for ax in figure.axes if ax.get_visible()]
    assert [(ax.get_title(), ax.get_xlabel()) for ax in shown] == [("loss", "step"), ("accuracy", "step")]
    drawn = [
        {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in ax.get_lines()} for ax in shown
    ]
    assert drawn == [
        {"bert/version_0": BERT["loss"], "gpt/version_0": GPT["loss"]},
        {"gpt/version_0": GPT["accuracy"]},
    ]
    assert [text.get_text() for text in shown[0].get_legend().get_texts()] == ["bert/version_0", "gpt/version_0"]


def test_a_failed_write_leaves_the_previous_image_and_no_temporary_file(logs, tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    output = tmp_path / "curves.png"
    output.write_bytes(b"the previous image")

    def savefig_that_dies_halfway(self, path, **kwargs):
        open(path, "wb").write(PNG_MAGIC)
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", savefig_that_dies_halfway)
    with pytest.raises(OSError, match="disk full"):
        plot_runs([logs], output)
    assert output.read_bytes() == b"the previous image"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["curves.png", "logs"]


# ---------------------------------------------------------------- the command
def test_fabriclite_plot_writes_a_png_in_new_folders_and_says_what_it_drew(logs, tmp_path):
    output = tmp_path / "plots" / "new" / "curves.png"
    result = run_python(
        "-m", "fabriclite.cli", "plot", str(logs), "-o", str(output), "--metrics", "loss, throughput", timeout=60
    )
    assert f"Wrote {output}: loss, throughput against step for 2 run(s): bert/version_0, gpt/version_0" in result.stdout
    image = output.read_bytes()
    assert image[:8] == PNG_MAGIC
    assert 10_000 < len(image) < 2_000_000
    assert [path.name for path in output.parent.iterdir()] == ["curves.png"]


def test_plot_is_a_listed_and_documented_subcommand(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "{run,plan,consolidate,plot}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plot", "--help"])
    assert "LOGDIR [LOGDIR ...]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{logs}/missing", "-o", "{logs}/c.png"], "'{logs}/missing' does not exist: pass a metrics.csv file, a"),
        (["{logs}/empty", "-o", "{logs}/c.png"], "'{logs}/empty' has no metrics.csv below it: pass a CSVLogger"),
        (["{logs}/gpt", "-o", "{logs}/c.jpg"], "output '{logs}/c.jpg' must end in .png, .pdf or .svg"),
        (
            ["{logs}/gpt", "-o", "{logs}/c.png", "--x", "epoch"],
            "no 'epoch' column for the x axis; its columns: accuracy, loss, step.",
        ),
        (
            ["{logs}/gpt", "-o", "{logs}/c.png", "--metrics", "loss,acc"],
            "unknown metric 'acc'; the runs have: accuracy, loss. Did you mean 'accuracy'?",
        ),
        (["{logs}/gpt", "-o", "{logs}/c.png", "--metrics", ","], "nothing to plot: name at least one metric; the runs"),
    ],
)
def test_bad_input_exits_2_naming_the_value_and_what_was_expected(logs, capsys, argv, message):
    (logs / "empty").mkdir()
    err = fails_with(capsys, "plot", *(arg.format(logs=logs) for arg in argv))
    assert message.format(logs=logs) in err
    assert not (logs / "c.png").exists()


def test_a_csv_without_a_step_column_is_refused_naming_the_file(tmp_path, capsys):
    path = tmp_path / "metrics.csv"
    path.write_text("epoch,loss\n0,1.0\n")
    err = fails_with(capsys, "plot", str(path), "-o", str(tmp_path / "c.png"))
    assert f"'{path}' has no 'step' column for the x axis; its columns: epoch, loss." in err


def test_without_matplotlib_plot_exits_1_with_the_install_hint_and_no_traceback(logs):
    code = (
        "import sys\n"
        "sys.modules['matplotlib'] = None  # what `import matplotlib` meets when it is not installed\n"
        "from fabriclite.cli import main\n"
        f"sys.exit(main(['plot', {str(logs)!r}, '-o', {str(logs / 'c.png')!r}]))\n"
    )
    result = run_python("-c", code, check=False, timeout=60)
    assert result.returncode == 1
    assert result.stderr == "fabriclite plot: error: fabriclite plot needs matplotlib: pip install 'fabriclite[plot]'\n"


def test_importing_fabriclite_and_its_cli_and_plot_modules_leaves_matplotlib_out():
    code = (
        "import sys, fabriclite, fabriclite.cli, fabriclite.plot\nprint([m for m in sys.modules if 'matplotlib' in m])"
    )
    assert run_python("-c", code, timeout=60).stdout.strip() == "[]"
