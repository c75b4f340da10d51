"""The tables and the issues' goals (met, MISSED or not measured) from the CSVs gpu_suite.py writes: models.csv,
vit.csv, frameworks.csv, overhead.csv, kernels.csv and fp8.csv in one folder. gpu_suite.py prints this at its end; run it alone to
summarise a folder again, after a run that was cut short, say. ``--verdict`` prints instead the one line that ends
gpu_run.sh, from the whole folder it wrote.

``--talk`` prints the table of the talk's runs that ``gpu_run.sh --talk`` made (fabriclite cold and warm, raw eager
PyTorch and raw torch.compile, one session) with the talk issue's goals.

Usage: ``python benchmarks/gpu_summary.py DIR``; ``python benchmarks/gpu_summary.py --verdict OUT [--smoke]``;
``python benchmarks/gpu_summary.py --talk OUT``.
"""

from __future__ import annotations

import csv
import json
import math
import re
import sys
from pathlib import Path

CSVS = ("models", "vit", "frameworks", "overhead", "kernels", "fp8")
NORM_OPS = ("rms_norm", "add_rms_norm", "layer_norm", "add_layer_norm")
IMPLEMENTATIONS = (  # kernels.py's
    "fabriclite", "fabriclite, row loop", "fabriclite, row chunks", "fabriclite, overwrite", "torch",
    "torch.compile", "liger",
)  # fmt: skip
WITHIN_RAW = {"frameworks": 1.02, "overhead": 1.03}  # the issue's ViT goal; overhead.py's GOAL
# gpu_run.sh --talk's runs: log name -> what ran. The talk issue's goals: cold at most 50 s and 0.85x raw eager,
# warm at most 45 s (one H100/H200).
TALK_RUNS = {
    "talk-cold": "fabriclite, empty caches",
    "talk-warm": "fabriclite, the caches of the run before",
    "raw-eager": "raw eager PyTorch",
    "raw-compile": "raw torch.compile, empty caches",
}
TALK_GOALS = {"cold_s": 50.0, "cold_vs_raw_eager": 0.85, "warm_s": 45.0}

Row = dict[str, str]


def read(folder: Path, name: str) -> list[Row]:
    path = folder / f"{name}.csv"
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def number(text: str | None) -> float:
    try:
        return float(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def goal(measured: float, ok: bool, text: str) -> str:
    """A goal's line: met or MISSED, or not measured when ``measured`` (the number it rests on) is missing."""
    return f"- {'not measured' if math.isnan(measured) else 'met' if ok else 'MISSED'}: {text}"


def models(rows: list[Row]) -> tuple[list[str], list[str]]:
    """in_model.py's rows: each kernel inside a training step, as a ratio to the same step with the kernels off."""
    table = ["| model | width | variant | step ms | samples/s | ratio vs off (best) | peak MiB | first step s | error |",
             "|---|---:|---|---:|---:|---|---:|---:|---|"]  # fmt: skip
    for r in rows:
        numbers = (
            "- | - | - | - | -"
            if r["error"]
            else f"{number(r['step_ms']):.2f} | {number(r['samples_per_s']):.0f} {r['samples']} | "
            f"{number(r['ratio_vs_off']):.3f} ({number(r['best_ratio_vs_off']):.3f}) | {number(r['peak_mib']):.0f} | "
            f"{number(r['first_step_s']):.1f}"
        )
        table.append(f"| {r['model']} | {r['width']} | {r['variant']} | {numbers} | {r['error']} |")
    ok = [r for r in rows if not r["error"] and r["kernels"]]
    wins = [f"{r['variant']} ({r['model']}, {number(r['ratio_vs_off']):.3f})" for r in ok
            if number(r["ratio_vs_off"]) <= 0.99]  # fmt: skip
    goals = [goal(0.0 if ok else math.nan, bool(wins), "a kernel at least 1% faster inside a model: "
                  + (", ".join(wins) if wins else "none"))]  # fmt: skip
    return table, goals


def fp8(rows: list[Row]) -> tuple[list[str], list[str]]:
    """in_model_fp8.py's rows: fp8-mixed against bf16-mixed in the GPT, compiled and eager, per width."""
    table = ["| width | variant | step ms | tokens/s | fp8 speed-up | peak MiB | first step s | loss | error |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        speedup = f"{number(r['speedup_vs_bf16']):.2f}x" if r["speedup_vs_bf16"] else "-"
        numbers = "- | - | - | - | - | -" if r["error"] else (
            f"{number(r['step_ms']):.1f} | {number(r['tokens_per_s']):.0f} | {speedup} | "
            f"{number(r['peak_mib']):.0f} | {number(r['first_step_s']):.1f} | {number(r['loss']):.4f}"
        )  # fmt: skip
        table.append(f"| {r['width']} | {r['variant']} | {numbers} | {r['error']} |")
    widest = max((number(r["width"]) for r in rows), default=math.nan)
    ok = {r["variant"]: r for r in rows if not r["error"] and number(r["width"]) == widest}
    x = number(ok.get("compiled fp8-mixed", {}).get("speedup_vs_bf16"))
    width = "4096" if math.isnan(widest) else f"{widest:.0f}"
    goals = [
        goal(
            x, x >= 1.25, f"GPT at width {width}, compiled: fp8-mixed at least 1.25x bf16-mixed's tokens/s ({x:.2f}x)"
        ),
        goal(math.nan, False, "GPT fp8-mixed's loss after 200 steps within 1% of bf16-mixed's (the suite runs a few)"),
    ]
    return table, goals


def vit(rows: list[Row]) -> tuple[list[str], list[str]]:
    table = ["| variant | batch | images/s | MFU | peak MiB | compile s | 3-epoch run s | error |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        mfu = f"{100 * number(r['mfu']):.1f}%" if r["mfu"] else "-"
        numbers = (
            "- | - | - | - | -"
            if r["error"]
            else f"{number(r['images_per_s']):.1f} | {mfu} | "
            f"{number(r['peak_mib']):.0f} | {number(r['compile_s']):.1f} | {number(r['three_epochs_s']):.1f}"
        )
        table.append(f"| {r['variant']} | {r['batch'] or '-'} | {numbers} | {r['error']} |")
    ok = {r["variant"]: r for r in rows if not r["error"]}
    goals = []
    if "fp32" in ok and "bf16-mixed" in ok:
        x = number(ok["bf16-mixed"]["images_per_s"]) / number(ok["fp32"]["images_per_s"])
        goals.append(goal(x, x >= 2.5, f"ViT bf16-mixed at least 2.5x fp32 images/s ({x:.2f}x)"))
    for mode in ("", " + compile"):  # issue 46: fp8 never slower than bf16-mixed at ViT-B/16's width of 768
        fp8, bf16 = ok.get(f"fp8-mixed{mode}"), ok.get(f"bf16-mixed{mode}")
        if fp8 and bf16:
            x = number(fp8["images_per_s"]) / number(bf16["images_per_s"])
            goals.append(goal(x, x >= 1.0, f"ViT fp8-mixed{mode} at least bf16-mixed{mode}'s images/s ({x:.2f}x)"))
    compiled = [number(r["mfu"]) for name, r in ok.items() if "compile" in name]
    if compiled:
        x = max(compiled)
        goals.append(goal(x, x >= 0.40, f"ViT with compile at least 40% MFU ({100 * x:.1f}%)"))
    if ok:
        best = min(ok.values(), key=lambda r: number(r["three_epochs_s"]))
        x = number(best["three_epochs_s"])
        goals.append(goal(x, x <= 60, f"the seed talk's 3-epoch run in at most 60 s on one H100 ({x:.1f} s estimated, "
                                      f"{best['variant']}; the talk on A100s: 18.5 min fp32, 6.4 min bf16-mixed, "
                                      "2.2 min on 4 GPUs)"))  # fmt: skip
    return table, goals


def comparison(rows: list[Row], within: float) -> tuple[list[str], list[str]]:
    table = ["| workload | precision | variant | ms/step | samples/s | ratio vs raw (p25-p75) | error |",
             "|---|---|---|---:|---:|---|---|"]  # fmt: skip
    for r in rows:
        numbers = (
            "- | - | -"
            if r["error"]
            else f"{number(r['ms_per_step']):.3f} | {number(r['samples_per_s']):.1f} | "
            f"{number(r['ratio_vs_raw']):.3f}x ({number(r['ratio_p25']):.3f}-{number(r['ratio_p75']):.3f})"
        )
        table.append(f"| {r['workload']} | {r['precision']} | {r['variant']} | {numbers} | {r['error']} |")
    goals = []
    for precision in dict.fromkeys(r["precision"] for r in rows):
        ok = {r["variant"]: r for r in rows if r["precision"] == precision and not r["error"]}
        if "fabriclite" not in ok:
            continue
        x = number(ok["fabriclite"]["ratio_vs_raw"])
        goals.append(goal(x, x <= within, f"fabriclite within {100 * (within - 1):.0f}% of raw at {precision} "
                                          f"({x:.3f}x)"))  # fmt: skip
        others = [name for name in ("lightning_fabric", "accelerate") if name in ok]
        if others:
            mine = number(ok["fabriclite"]["ms_per_step"])
            ahead = all(mine < number(ok[name]["ms_per_step"]) for name in others)
            ratios = ", ".join(f"{name} {number(ok[name]['ratio_vs_raw']):.3f}x" for name in others)
            goals.append(goal(mine, ahead, f"fabriclite ahead of {' and '.join(others)} at {precision} ({ratios})"))
    return table, goals


def kernels(rows: list[Row]) -> tuple[list[str], list[str]]:
    cells: dict[tuple[str, str, str], dict[str, Row]] = {}
    for r in rows:
        cells.setdefault((r["op"], r["shape"], r["mode"]), {})[r["implementation"]] = r

    def value(by: dict[str, Row], name: str, key: str) -> float:
        return number(by[name][key]) if name in by and not by[name]["error"] else math.nan

    def cell(by: dict[str, Row], name: str) -> str:
        if name not in by:
            return "-"
        if by[name]["error"]:
            return by[name]["error"].split(":")[0]
        return (f"{value(by, name, 'ms'):.3f} ms, {100 * value(by, name, 'fraction_of_copy'):.0f}% of copy, "
                f"{value(by, name, 'peak_mib'):.0f} MiB")  # fmt: skip

    table = [
        "| op | shape | mode | " + " | ".join(IMPLEMENTATIONS) + " |",
        "|---|---|---|" + "---|" * len(IMPLEMENTATIONS),
    ]
    table += [f"| {op} | {shape} | {mode} | " + " | ".join(cell(by, n) for n in IMPLEMENTATIONS) + " |"
              for (op, shape, mode), by in cells.items()]  # fmt: skip
    goals = []
    for (op, shape, mode), by in cells.items():
        if mode != "both":
            continue
        if op == "cross_entropy":
            x = value(by, "torch", "ms") / value(by, "fabriclite", "ms")
            goals.append(goal(x, x >= 2, f"cross-entropy {shape} at least 2x eager forward+backward ({x:.2f}x)"))
            x = value(by, "fabriclite", "peak_mib") / value(by, "torch", "peak_mib")
            goals.append(goal(x, x <= 1 / 3, f"cross-entropy {shape} at most 1/3 of eager's peak memory ({x:.2f})"))
            x = value(by, "liger", "ms") / value(by, "fabriclite", "ms")
            note = f"Liger's time / ours: {x:.2f}" if "liger" in by else "liger-kernel not installed"
            goals.append(goal(x, x >= 1, f"cross-entropy {shape} at least Liger's speed ({note})"))
        if op == "linear_cross_entropy":
            x = value(by, "fabriclite", "peak_mib") / value(by, "torch", "peak_mib")
            goals.append(goal(x, x <= 1 / 5, f"linear cross-entropy {shape} at most 1/5 of eager's peak memory "
                                             f"({x:.2f})"))  # fmt: skip
            for name in ("fabriclite", "fabriclite, row chunks"):
                if name in by:
                    x = value(by, "torch", "ms") / value(by, name, "ms")
                    memory = value(by, name, "peak_mib") / value(by, "torch", "peak_mib")
                    goals.append(goal(x, x >= 1 and memory <= 1 / 5, f"linear cross-entropy {shape} ({name}) at "
                                      f"most eager's time with at most 1/5 of its memory (eager's time / ours: "
                                      f"{x:.2f}; memory {memory:.2f})"))  # fmt: skip
    norms = {key: by for key, by in cells.items() if key[0] in NORM_OPS and "fabriclite" in by}
    if norms:
        slow = [" ".join(key) for key, by in norms.items() if not value(by, "fabriclite", "fraction_of_copy") >= 0.85]
        behind = [" ".join(key) for key, by in norms.items()
                  if not value(by, "fabriclite", "ms") <= value(by, "torch.compile", "ms")]  # fmt: skip
        goals.append(goal(0.0, not slow, f"norms at least 85% of copy bandwidth: {len(norms) - len(slow)} of "
                                         f"{len(norms)}" + (f" (below: {', '.join(slow)})" if slow else "")))  # fmt: skip
        goals.append(goal(0.0, not behind, f"norms never slower than torch.compile: {len(norms) - len(behind)} of "
                                           f"{len(norms)}" + (f" (slower: {', '.join(behind)})" if behind else "")))  # fmt: skip
    # Issue 40: the norm backward in tiles against the row loop it replaced (a ratio above 1: the tiles faster).
    designs = {key: value(by, "fabriclite, row loop", "ms") / value(by, "fabriclite", "ms")
               for key, by in norms.items() if key[2] != "forward" and "fabriclite, row loop" in by}  # fmt: skip
    if designs:
        x = min(designs.values())
        ratios = ", ".join(f"{' '.join(key)} {ratio:.2f}" for key, ratio in designs.items())
        goals.append(goal(x, x >= 1, f"norm backward in tiles at least as fast as the row loop (the row loop's time "
                                     f"over the tiles', above 1: the tiles faster: {ratios})"))  # fmt: skip
    return table, goals


def summarize(folder: Path, notes: tuple[str, ...] = ()) -> str:
    """The markdown summary of the CSVs in ``folder``, with ``notes`` (how each section ended) under its title.

    Usage: ``print(summarize(Path("results")))``.
    """
    rows = {name: read(folder, name) for name in CSVS}
    first = next((r for table in rows.values() for r in table), None)
    run = first["run"] if first else "empty"
    lines = [f"# GPU suite ({run} run)", ""]
    if run == "smoke":
        lines += ["**Smoke run: tiny shapes on a CPU. The rows check that the suite works; they are not measurements "
                  "and say nothing about a GPU.**", ""]  # fmt: skip
    if first:
        lines.append(f"- device: {first['device']}; torch {first['torch']}, triton {first['triton'] or '-'}, "
                     f"CUDA {first['cuda'] or '-'}")  # fmt: skip
    lines += [f"- {note}" for note in notes] + [""]
    goals = []
    for title, (table, found) in (
        ("Kernels inside models (a ratio below 1: faster with the kernels)", models(rows["models"])),
        ("ViT step through fabriclite", vit(rows["vit"])),
        ("ViT step by library", comparison(rows["frameworks"], WITHIN_RAW["frameworks"])),
        ("Per-step overhead of a tiny model", comparison(rows["overhead"], WITHIN_RAW["overhead"])),
        ("Kernels in bf16 (median time, throughput as a share of the copy bandwidth, peak memory)", kernels(rows["kernels"])),
        ("fp8-mixed against bf16-mixed in the GPT (a speed-up above 1: fp8 is faster)", fp8(rows["fp8"])),
    ):  # fmt: skip
        lines += [f"## {title}", "", *table, ""]
        goals += found
    lines += ["## Goals" + (" (smoke run: these verdicts mean nothing)" if run == "smoke" else ""), "", *goals]
    return "\n".join(lines) + "\n"


def talk_result(log: str) -> dict | None:
    """The RESULT record a talk run's log ends with (the series' JSON line), with its epochs' training seconds."""
    found = re.search(r"^RESULT (\{.*\})$", log, re.MULTILINE)
    if not found:
        return None
    record = json.loads(found.group(1))
    record["train_s"] = [float(s) for s in re.findall(r"^epoch \d+/\d+ .* train ([\d.]+) s", log, re.MULTILINE)]
    return record


def talk(out: Path, smoke: bool = False) -> str:
    """The markdown table of the talk's runs in ``out`` (gpu_run.sh --talk) and the talk issue's goals; a ``smoke``
    run (tiny shapes on a CPU) says that its figures mean nothing.

    Usage: ``print(talk(Path("OUT")))``.
    """
    records = {}
    for name in TALK_RUNS:
        path = out / f"{name}.log"
        records[name] = talk_result(path.read_text(errors="replace")) if path.exists() else None
    raw = (records["raw-eager"] or {}).get("seconds", math.nan)
    lines = [
        "# The talk's run: fabriclite against raw PyTorch, one session",
        "",
        *(["**Smoke run: tiny shapes on a CPU. It checks the runs work; its figures say nothing.**", ""] * smoke),
        "| run | what | end to end (s) | epochs' training (s) | images/s (last epoch) | vs raw eager |",
        "|---|---|---|---|---|---|",
    ]
    for name, what in TALK_RUNS.items():
        record = records[name]
        if record is None:
            lines.append(f"| {name} | {what} | did not finish | | | |")
            continue
        epochs = ", ".join(f"{s:.1f}" for s in record["train_s"])
        ratio = record["seconds"] / raw  # nan without a raw eager run
        lines.append(f"| {name} | {what} | {record['seconds']:.1f} | {epochs} | {record['images_per_s']:.0f} | "
                     f"{ratio:.3f} |")  # fmt: skip
    first = next((r for r in records.values() if r), None)
    if first:
        lines += ["", f"- device: {first['device']}"]
    cold = (records["talk-cold"] or {}).get("seconds", math.nan)
    warm = (records["talk-warm"] or {}).get("seconds", math.nan)
    ratio, most = cold / raw, TALK_GOALS["cold_vs_raw_eager"]
    lines += [
        "",
        "## Goals" + (" (smoke run: these verdicts mean nothing)" if smoke else ""),
        "",
        goal(cold, cold <= TALK_GOALS["cold_s"], f"cold at most {TALK_GOALS['cold_s']:.0f} s ({cold:.1f} s)"),
        goal(ratio, ratio <= most, f"cold at most {most}x raw eager ({ratio:.3f})"),
        goal(warm, warm <= TALK_GOALS["warm_s"], f"warm at most {TALK_GOALS['warm_s']:.0f} s ({warm:.1f} s)"),
    ]
    return "\n".join(lines) + "\n"


def verdict(out: Path, smoke: bool = False) -> tuple[bool, str]:
    """(passed, the line) for a folder gpu_run.sh wrote: ``GPU CHECKS PASSED`` or ``GPU CHECKS FAILED: ...`` naming
    each step that did not end 0 (or did not start), each kernel test that failed, each models or kernels row with an
    error, and a talk's run without its RESULT line. Rows the suite skipped for time (by design, the least important
    last) are counted, not failed. A ``smoke`` run says SMOKE instead of GPU: it measures nothing.

    Usage: ``passed, line = verdict(Path("OUT"))``.
    """

    def text(name: str) -> str | None:
        path = out / name
        return path.read_text(errors="replace") if path.exists() else None

    failures, skipped = [], 0
    log = text("run.log") or ""
    for name, code in re.findall(r"^===== ([\w-]+): exit (\d+) after", log, re.MULTILINE):
        if code != "0":
            failures.append(f"{name} exited {code}" + (" (out of time)" if code in ("124", "137") else ""))
    failures += [f"{name} did not start (deadline)" for name in re.findall(r"^===== ([\w-]+): skipped", log, re.M)]
    tests = text("kernel-tests-compiled.log")
    if tests is not None:
        failed = re.search(r"(\d+) (failed|error)", tests)
        if failed:
            failures.append(f"{failed.group(1)} kernel tests {failed.group(2)}")
    for section in ("models", "kernels"):
        for row in read(out / "suite", section):
            error = row.get("error") or ""
            if error.startswith("skipped"):
                skipped += 1
            elif error:
                where = " ".join(
                    row.get(key) or "" for key in ("model", "variant", "op", "shape", "mode", "implementation")
                )
                failures.append(f"{section} row '{' '.join(where.split())}': {error.splitlines()[0][:120]}")
    for run in TALK_RUNS:
        log_text = text(f"{run}.log")
        if log_text is not None and "RESULT" not in log_text:
            failures.append(f"{run}: the talk's run did not finish")
    kind = "SMOKE" if smoke else "GPU"
    note = f" ({skipped} rows skipped for time)" if skipped else ""
    if failures:
        return False, f"{kind} CHECKS FAILED: " + "; ".join(failures) + note
    return True, f"{kind} CHECKS PASSED{note}"


if __name__ == "__main__":
    if sys.argv[1] == "--talk":
        print(talk(Path(sys.argv[2]), smoke="--smoke" in sys.argv[3:]), end="")
        sys.exit(0)
    if sys.argv[1] == "--verdict":
        passed, line = verdict(Path(sys.argv[2]), smoke="--smoke" in sys.argv[3:])
        print(line)
        sys.exit(0 if passed else 1)
    print(summarize(Path(sys.argv[1])))
