"""benchmarks/gpu_suite.py --smoke: every section runs on the CPU at tiny sizes and writes its CSV, and every row names
the run, the device and the versions, so that a smoke row can never pass for a GPU result."""

import csv
import json
import re
import sys
import tarfile

import pytest
import torch
from helpers import ROOT, run_command, run_python

SUITE = ROOT / "benchmarks" / "gpu_suite.py"
RUN = ROOT / "benchmarks" / "gpu_run.sh"
CSVS = {
    "vit": {
        "fp32",
        "bf16-mixed",
        "bf16-mixed + kernels",
        "bf16-mixed + compile",
        "bf16-mixed + compile + kernels",
        "fp8-mixed",
        "fp8-mixed + compile",
    },
    "frameworks": {"raw", "fabriclite", "lightning_fabric", "accelerate"},
    "overhead": {"raw", "fabriclite", "lightning_fabric", "accelerate"},
    # kernels.py's IMPLEMENTATIONS less Liger (not installed here)
    "kernels": {
        "fabriclite",
        "fabriclite, row loop",
        "fabriclite, row chunks",
        "fabriclite, overwrite",
        "torch",
        "torch.compile",
    },
}
# What a row may report instead of a number: an optional package this machine lacks.
MISSING_PACKAGE = "No module named"


def test_the_smoke_run_writes_every_csv_with_the_cpu_named_in_every_row(tmp_path):
    sections = ("vit", "compare", "kernels")  # models has a test of its own, below
    result = run_python(
        str(SUITE), "--out", str(tmp_path), "--smoke", "--sections", *sections, timeout=180, check=False
    )
    log = (tmp_path / "suite.log").read_text() if (tmp_path / "suite.log").exists() else ""
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{log[-3000:]}"

    for name, variants in CSVS.items():
        with open(tmp_path / f"{name}.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        key = "implementation" if name == "kernels" else "variant"
        assert {row[key] for row in rows} == variants, f"{name}.csv: {[row[key] for row in rows]}"
        if name in ("frameworks", "overhead"):  # every library at both precisions, each in its own process
            assert sorted((row["precision"], row["variant"]) for row in rows) == sorted(
                (precision, variant) for precision in ("32-true", "bf16-mixed") for variant in variants
            )
        for row in rows:
            assert row["run"] == "smoke" and row["device"].startswith("CPU: "), row
            assert row["torch"] == torch.__version__ and row["time"], row
            assert not row["error"] or MISSING_PACKAGE in row["error"], f"{name}.csv: {row['error']}"
        measured = [row for row in rows if not row["error"]]
        assert measured, f"{name}.csv has no measured row"
        column = {"vit": "images_per_s", "kernels": "ms"}.get(name, "ms_per_step")
        assert all(float(row[column]) > 0 for row in measured), [row[column] for row in measured]

    summary = (tmp_path / "summary.md").read_text()
    assert "Smoke run: tiny shapes on a CPU" in summary and "## Goals (smoke run" in summary
    assert summary in result.stdout


def test_gpu_run_smoke_measures_every_model_variant_on_the_kernels_it_names_and_packs_every_file(tmp_path):
    """benchmarks/gpu_run.sh --smoke: the GPU command's steps on the CPU (host cost, the models section, the talk's
    run twice), each ending cleanly, and the models rows as the section promises."""
    run_command("bash", str(RUN), str(tmp_path), "--smoke", timeout=900, PYTHON=sys.executable)
    log = (tmp_path / "run.log").read_text()
    for step in ("host-cost", "models", "talk-cold", "talk-warm"):
        assert f"===== {step}: exit 0 after" in log, log
    assert log.splitlines()[-1].startswith("SMOKE CHECKS PASSED"), log
    host_cost = (tmp_path / "host-cost.md").read_text()
    assert "| layer_norm |" in host_cost and "_norm.py" in host_cost.split("spends its host time", 1)[1], host_cost
    assert "RESULT" in (tmp_path / "talk-warm.log").read_text()
    with tarfile.open(tmp_path / "results.tar.gz") as packed:
        assert {"./run.log", "./suite/models.csv", "./talk-cold.log"} <= set(packed.getnames())
    tmp_path = tmp_path / "suite"
    with open(tmp_path / "models.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    gpt_kernels = ["rms_norm", "rope", "swiglu", "linear_cross_entropy"]
    expected = {
        ("vit", "eager", ""), ("vit", "eager + all kernels", "layer_norm"), ("vit", "compiled", ""),
        ("vit", "compiled + all kernels", "layer_norm"), ("gpt", "eager", ""), ("gpt", "compiled", ""),
        ("gpt", "eager + all kernels", " ".join(gpt_kernels)), ("gpt", "compiled + all kernels", " ".join(gpt_kernels)),
        *(("gpt", f"eager + {op}", op) for op in gpt_kernels),
    }  # fmt: skip
    assert {(row["model"], row["variant"], row["kernels"]) for row in rows} == expected
    for row in rows:
        assert row["run"] == "smoke" and row["device"].startswith("CPU: ") and not row["error"], row
        assert float(row["step_ms"]) > 0 and float(row["ratio_vs_off"]) > 0, row
        # The norms are swapped exactly where the variant names them: 2 per block and the final one.
        norms_named = "layer_norm" in row["kernels"] or "rms_norm" in row["kernels"]
        assert int(row["swapped_norms"]) == (5 if norms_named else 0), row
        if row["kernels"] == "":
            assert float(row["ratio_vs_off"]) == 1.0, row  # the baseline against itself
    assert "## Kernels inside models" in (tmp_path / "summary.md").read_text()


def test_gpu_run_fits_one_command_of_a_lent_gpu_machine():
    """A lent machine runs one command for at most 600 s: the GPU steps' limits fit the script's deadline, and the
    deadline leaves a minute of those 600 s (the H200 run of 2026-11-27 had limits adding up to 705 s)."""
    script = RUN.read_text()
    deadline = int(re.search(r"^deadline=(\d+)", script, re.MULTILINE).group(1))
    gpu_part = script[script.index("export TRITON_INTERPRET=0") :]
    limits = [int(limit) for limit in re.findall(r"^\s*step [\w-]+ (\d+) ", gpu_part, re.MULTILINE)]
    assert len(limits) == 6, gpu_part
    assert sum(limits) + 10 <= deadline <= 540, (limits, deadline)
    talk_part = script[script.index('elif [ "$mode" = talk ]; then') : script.index('elif [ "$smoke" = "--smoke" ]')]
    talk_limits = [int(limit) for limit in re.findall(r"^\s*step [\w-]+ (\d+) ", talk_part, re.MULTILINE)]
    assert len(talk_limits) == 4 and sum(talk_limits) + 10 <= deadline, talk_part


@pytest.mark.timeout(900)
def test_gpu_run_talk_smoke_runs_fabriclite_and_raw_pytorch_on_the_talks_work_and_tables_them(tmp_path):
    """gpu_run.sh --talk --smoke: the talk's run through fabriclite (twice) and in raw PyTorch (eager, and compiled
    with empty caches of its own), on the CPU at the talk's CI shape, each with its RESULT line, and the table."""
    run_command("bash", str(RUN), str(tmp_path), "--talk", "--smoke", timeout=840, PYTHON=sys.executable)
    log = (tmp_path / "run.log").read_text()
    for step in ("raw-eager", "talk-cold", "talk-warm", "raw-compile"):
        assert f"===== {step}: exit 0 after" in log, log
    assert log.splitlines()[-1].startswith("SMOKE CHECKS PASSED"), log
    assert '"model": "raw PyTorch + torch.compile' in (tmp_path / "raw-compile.log").read_text()
    table = (tmp_path / "talk.md").read_text()
    assert "Smoke run" in table and "did not finish" not in table, table
    assert re.search(r"^\| raw-eager \| raw eager PyTorch \| [\d.]+ \| [\d.]+ \| \d+ \| 1.000 \|$", table, re.M), table


def test_the_talk_table_gives_each_run_against_raw_eager_and_the_goals_met_or_missed(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_summary import talk, verdict

    def result(seconds, epochs):
        lines = [
            f"epoch {i + 1}/2  loss 0.1  test acc 90.0%  train {s} s, epoch with eval {s} s"
            for i, s in enumerate(epochs)
        ]
        record = {"seconds": seconds, "images_per_s": 3000.0, "device": "NVIDIA H200"}
        return "\n".join([*lines, f"RESULT {json.dumps(record)}", ""])

    (tmp_path / "raw-eager.log").write_text(result(60.0, [20.0, 19.0]))
    (tmp_path / "talk-cold.log").write_text(result(48.0, [18.0, 15.0]))
    (tmp_path / "talk-warm.log").write_text(result(46.0, [16.0, 15.0]))
    (tmp_path / "raw-compile.log").write_text("epoch 1/2 ...\n")  # cut short: no RESULT line
    table = talk(tmp_path)
    assert "| talk-cold | fabriclite, empty caches | 48.0 | 18.0, 15.0 | 3000 | 0.800 |" in table, table
    assert "| raw-compile | raw torch.compile, empty caches | did not finish |" in table, table
    assert "- met: cold at most 50 s (48.0 s)" in table and "- met: cold at most 0.85x raw eager (0.800)" in table
    assert "- MISSED: warm at most 45 s (46.0 s)" in table, table
    (tmp_path / "raw-eager.log").unlink()
    assert "- not measured: cold at most 0.85x raw eager" in talk(tmp_path)
    assert "raw-compile: the talk's run did not finish" in verdict(tmp_path)[1]


def test_a_model_variant_whose_first_step_fails_gets_its_own_error_and_the_others_keep_their_times(monkeypatch):
    """One variant's failing compile wrote its error over every row of its group (the H200 run of 2026-11-27 showed
    'gpt compiled' failing with the error of 'gpt compiled + all kernels')."""
    import dataclasses

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import in_model

    real_set_up = in_model.set_up

    def set_up(model_name, variant, run, device, sizes=None):
        runner = real_set_up(model_name, variant, run, device, sizes)
        if variant.name != "compiled + all kernels":
            return runner

        def fails(*batch):
            raise RuntimeError("the compile failed")

        return dataclasses.replace(runner, step=fails)

    monkeypatch.setattr(in_model, "set_up", set_up)
    rows = []
    in_model.run_models(lambda **row: rows.append(row), "smoke", lambda: False, models=("vit",))
    compiled = {row["variant"]: row for row in rows if row["compiled"]}
    assert compiled["compiled + all kernels"]["error"] == "RuntimeError: the compile failed"
    assert compiled["compiled"]["error"] == "" and compiled["compiled"]["step_ms"] > 0, compiled


def test_the_gpu_runs_verdict_names_every_failed_step_test_row_and_unfinished_talk_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from gpu_summary import verdict

    (tmp_path / "run.log").write_text(
        "===== kernel-tests: exit 1 after 70 s\n===== models: exit 0 after 80 s\n===== kernels: exit 124 after 100 s\n"
        "===== talk-warm: skipped, 540 s deadline reached\n"
    )
    (tmp_path / "kernel-tests-compiled.log").write_text("2 failed, 269 passed in 64.0s\n")
    (tmp_path / "talk-cold.log").write_text("epoch 1/3 ...\n")  # no RESULT line: it did not finish
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "models.csv").write_text(
        "model,variant,error\ngpt,compiled,\ngpt,compiled + all kernels,InductorError: KeyError: 'op24'\n"
        "vit,compiled,skipped: out of time\n"
    )
    passed, line = verdict(tmp_path)
    assert not passed and line.startswith("GPU CHECKS FAILED: ")
    for part in ("kernel-tests exited 1", "kernels exited 124 (out of time)", "talk-warm did not start (deadline)",
                 "2 kernel tests failed", "models row 'gpt compiled + all kernels': InductorError: KeyError: 'op24'",
                 "talk-cold: the talk's run did not finish", "(1 rows skipped for time)"):  # fmt: skip
        assert part in line, line
    for name in ("run.log", "kernel-tests-compiled.log", "talk-cold.log", "suite/models.csv"):
        (tmp_path / name).unlink()
    (tmp_path / "run.log").write_text("===== models: exit 0 after 80 s\n")
    (tmp_path / "talk-cold.log").write_text("RESULT ...\n")
    assert verdict(tmp_path) == (True, "GPU CHECKS PASSED")


def test_the_fp8_section_measures_fp8_against_bf16_in_the_gpt_compiled_and_eager(monkeypatch):
    """gpu_suite.py's fp8 section (issue 46) at the smoke size: both precisions in both modes, fp8's speed-up and loss
    next to bf16's, and the summary's goal line for the widest GPT."""
    pytest.importorskip("torchao", reason="fp8-mixed needs torchao (the dev extra installs it)")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_summary
    import in_model_fp8

    rows = []
    in_model_fp8.run_fp8(lambda **row: rows.append(row), "smoke", lambda: False)
    assert [(row["variant"], row["precision"]) for row in rows] == [
        ("compiled bf16-mixed", "bf16-mixed"),
        ("compiled fp8-mixed", "fp8-mixed"),
        ("eager bf16-mixed", "bf16-mixed"),
        ("eager fp8-mixed", "fp8-mixed"),
    ]
    for bf16, fp8 in (rows[:2], rows[2:]):
        assert not bf16["error"] and not fp8["error"], (bf16, fp8)
        assert bf16["speedup_vs_bf16"] == 1.0 and fp8["speedup_vs_bf16"] > 0 and fp8["tokens_per_s"] > 0
        assert abs(fp8["loss"] - bf16["loss"]) < 0.05 * bf16["loss"] and fp8["loss"] != bf16["loss"]
    _, goals = gpu_summary.fp8([{key: str(value) for key, value in row.items()} for row in rows])
    assert "GPT at width 32, compiled: fp8-mixed at least 1.25x bf16-mixed's tokens/s" in goals[0]
