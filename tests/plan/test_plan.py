"""``fabriclite plan`` against the real thing: the examples' GPT and ViT scripts and the talk's ViT-B/16 script,
unchanged, planned as rank 0 of 1, 2 or 4 processes, compared with real runs of the same script on as many gloo
processes (``fabriclite run``), stopped after the same two optimizer steps, whose peak memory torch's profiler counts
allocation by allocation and whose tensors alive are counted as the plan counts them (tests/scripts/measure_memory.py);
and wrong configurations, which must fail in the plan as they fail at launch. Each plan runs in one process of its
own (the ``fabriclite plan`` command), as a user runs it. The rows too slow for CI (the GPT's DDP and FSDP2 on 4
ranks, the ViT's others) are benchmarks/plan_memory.py's."""

import json
import math
import re
import runpy
from dataclasses import replace

import pytest
import torch
from helpers import ROOT, SCRIPTS, run_python

from fabriclite.cli import main as cli
from fabriclite.plan import Plan

GPT = str(ROOT / "examples" / "gpt" / "train.py")
CONFIGS = str(SCRIPTS / "plan_configs.py")
TIMEOUT = 600  # a loaded 2-core machine: a real 2-process step of the GPT takes seconds, its plan as long
GPT_PARAMETERS = 842_496  # GPTConfig(): the default model of examples/gpt/train.py


def plan(*args: str, check: bool = False) -> dict:
    result = run_python("-m", "fabriclite.cli", "plan", "--json", *args, timeout=TIMEOUT, check=check)
    assert result.stdout.strip(), result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def measured(devices: int, *script: str) -> tuple[list[int], list[int]]:
    """Each rank's peak in a real run: as torch's profiler counts allocations, and of the tensors alive."""
    result = run_python(
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", str(devices),
        str(SCRIPTS / "measure_memory.py"), *script, timeout=TIMEOUT,
    )  # fmt: skip
    found = sorted(re.findall(r"MEASURED (\d+) (\d+) steps (\d+) alive (\d+) stepping (\d+)", result.stdout))
    assert len(found) == devices and all(steps == "2" for _, _, steps, _, _ in found), result.stdout[-3000:]
    return [int(peak) for _, peak, _, _, _ in found], [int(alive) for _, _, _, alive, _ in found]


def measured_steps_alive(devices: int, *script: str) -> list[int]:
    """Each rank's peak of the tensors alive in a real run, from the first forward on (the plan's peak of the
    steps), and as torch's profiler counts allocations from the start."""
    result = run_python(
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", str(devices),
        str(SCRIPTS / "measure_memory.py"), *script, timeout=TIMEOUT,
    )  # fmt: skip
    found = sorted(re.findall(r"MEASURED (\d+) (\d+) steps 2 alive \d+ stepping (\d+)", result.stdout))
    assert len(found) == devices, result.stdout[-3000:]
    return [int(alive) for _, _, alive in found], [int(peak) for _, peak, _ in found]


def measured_peaks(devices: int, *script: str) -> list[int]:
    return measured(devices, *script)[0]


@pytest.mark.parametrize("devices", [1, 2])
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_planned_peak_of_the_gpt_example_is_within_10_percent_of_a_real_run(tmp_path, strategy, devices):
    args = [GPT, "--strategy", strategy, "--eval-windows", "32", "--out-dir", str(tmp_path / "run")]
    predicted = plan("--devices", str(devices), *args, check=True)
    measured = measured_peaks(devices, *args)
    assert predicted["ok"] and predicted["steps"] == 2 and predicted["error"] is None
    # The ranks hold the same tensors; a rank whose gloo collectives finish late holds their buffers longer (16 MB
    # more on rank 0 than on rank 1 of one DDP run on a loaded machine), which the plan, whose collectives end at
    # once, does not count: it is held to the rank that held least.
    least = min(measured)
    assert abs(predicted["peak_bytes"] - least) <= 0.10 * least, (predicted["peak_bytes"], measured)
    # The kinds are counted, not guessed: rank 0 holds its share of the fp32 weights, AdamW two moments of each
    # (plus a step count per parameter tensor), and the parts add up to the peak.
    shard = GPT_PARAMETERS // devices if strategy == "fsdp" else GPT_PARAMETERS
    memory = predicted["memory"]
    assert memory["parameters"] == 4 * shard
    assert 2 * 4 * shard <= memory["optimizer state"] <= 2 * 4 * shard + 4 * 64
    assert sum(memory.values()) == predicted["peak_bytes"]
    assert memory["activations and temporaries"] > memory["parameters"]  # the batch's activations dominate here


# Parameters rank 0 holds under tensor parallel 2 x FSDP 2: per block, column-split q, k, v and MLP up projection
# (weights and biases halved), row-split output projections (weights halved, biases whole), norms whole; the
# embeddings and the last norm whole; FSDP then halves all of it. HSDP shards over 2 and replicates.
TP_BLOCK = (
    2 * 256 + 3 * (128 * 128 + 128) // 2 + (128 * 128 // 2 + 128) + (128 * 512 + 512) // 2 + (512 * 128 // 2 + 128)
)
SHARES = {"tp": (4 * TP_BLOCK + 256 * 128 + 128 * 128 + 256) // 2, "hsdp": GPT_PARAMETERS // 2}


@pytest.mark.parametrize(
    "layout, mesh, share",
    [
        (("--tp", "2"), "data_parallel 2 x tensor_parallel 2", "tp"),
        (("--hsdp", "2"), "replicate 2 x shard 2", "hsdp"),
    ],
    ids=["tensor-parallel-2-x-fsdp-2", "hsdp-2-replicas-x-2-shards"],
)
def test_tensor_parallel_and_hsdp_plans_of_the_gpt_are_within_10_percent_of_a_real_run_on_4_ranks(
    tmp_path, layout, mesh, share
):
    args = [GPT, *layout, "--eval-windows", "32", "--out-dir", str(tmp_path / "run")]
    predicted = plan("--devices", "4", *args, check=True)
    assert predicted["ok"] and predicted["steps"] == 2 and predicted["limit"] is None
    assert predicted["configuration"]["device mesh"] == mesh
    allocated, alive = measured(4, *args)
    # The tensors alive on every rank (every rank of these meshes holds the same shapes as rank 0).
    for rank, peak in enumerate(alive):
        assert abs(predicted["peak_bytes"] - peak) <= 0.10 * peak, (rank, predicted["peak_bytes"], alive)
    # The profiler also counts scratch inside kernels and gloo, which overlaps the peak more or less as the
    # processes' threads run: the plan, which has no such scratch, may only be below it, and not by much.
    assert 0.80 * allocated[0] <= predicted["peak_bytes"] <= 1.10 * allocated[0], (predicted["peak_bytes"], allocated)
    memory = predicted["memory"]
    assert memory["parameters"] == 4 * SHARES[share]  # fp32
    assert 2 * memory["parameters"] <= memory["optimizer state"] <= 2 * memory["parameters"] + 4 * 128, memory
    assert [kind["ranks"] for kind in predicted["kinds_of_rank"]] == [[0, 1, 2, 3]]  # the GPT's sizes divide by 2


def test_the_last_rank_of_an_uneven_split_is_a_kind_of_its_own_and_planned_as_it_is_it_matches_a_real_run():
    # A layer of 9 outputs sharded over 4 ranks: ranks 0-2 hold 3 rows each, rank 3 none. One command plans rank 0,
    # then rank 3 (--every-kind), in the same process.
    first = plan("--devices", "4", "--every-kind", CONFIGS, "uneven", check=True)
    of_rank = {0: first, 3: first["other_kinds"][0]}
    assert len(first["other_kinds"]) == 1
    for rank, predicted in of_rank.items():
        assert predicted["ok"] and predicted["rank"] == rank and predicted["steps"] == 2
        kinds = predicted["kinds_of_rank"]
        assert [kind["ranks"] for kind in kinds] == [[0, 1, 2], [3]]
        assert kinds[0]["holds"] - kinds[1]["holds"] == 3 * 4096 + 3
    assert first["kinds_of_rank"][1]["differs"][0] == ["2.weight", [0, 4096], [3, 4096]]
    # FSDP2 pads every rank's shard to the same size (parameters and gradients alike); AdamW's moments are as
    # large as the rank's own rows: rank 3 holds 2 x 4 bytes x 12,291 less of them.
    assert of_rank[0]["memory"]["parameters"] == of_rank[3]["memory"]["parameters"]
    assert of_rank[0]["memory"]["optimizer state"] - of_rank[3]["memory"]["optimizer state"] == 2 * 4 * 12_291
    allocated, alive = measured(4, CONFIGS, "uneven")
    for rank, predicted in of_rank.items():
        assert abs(predicted["peak_bytes"] - alive[rank]) <= 0.10 * alive[rank], (rank, predicted["peak_bytes"], alive)
    # What the plan tells apart, a real run shows: rank 3 below ranks 0-2.
    assert alive[3] < min(alive[:3]) and of_rank[3]["peak_bytes"] < of_rank[0]["peak_bytes"], alive


def test_activations_are_planned_with_and_without_the_checkpointing_the_script_sets_and_match_real_runs_of_both():
    predicted = plan("--devices", "1", CONFIGS, "checkpointed", "512", check=True)
    assert predicted["configuration"]["activation checkpointing"] == "activation_checkpointing_policy={Block}"
    without = predicted["without_activation_checkpointing"]
    assert without["activations"] > predicted["memory"]["activations and temporaries"]
    # Real runs on a gloo process: the script as it is, and with plain FSDP (no checkpointing) on the same batches.
    checkpointed = measured_peaks(1, CONFIGS, "checkpointed", "512")[0]
    plain = measured_peaks(1, CONFIGS, "fine", "512")[0]
    assert abs(predicted["peak_bytes"] - checkpointed) <= 0.10 * checkpointed, (predicted["peak_bytes"], checkpointed)
    assert abs(without["peak_bytes"] - plain) <= 0.10 * plain, (without, plain)
    assert abs(predicted["peak_bytes"] - plain) > 0.10 * plain  # the two figures are told apart


def test_the_plan_reports_the_configuration_fabriclite_resolved(tmp_path):
    args = [GPT, "--quick", "--strategy", "fsdp", "--precision", "bf16-mixed", "--out-dir", str(tmp_path)]
    config = plan("--devices", "4", "--num-nodes", "2", *args, check=True)["configuration"]
    assert config["strategy"] == "FSDPStrategy, 8 processes on cpu"
    assert config["device mesh"] == "dim0 8"
    assert config["FSDP units"].startswith("3: 2 x Block, the root")
    assert config["precision"] == "bf16-mixed: forward computes in bfloat16"
    assert config["model"] == "GPT, 120,576 parameters; this rank holds 15,072 (float32)"
    assert config["model compile"] == "off (eager)"
    assert config["optimizer"] == "AdamW; state float32"


@pytest.mark.parametrize(
    "config, expected",
    [
        ("hybrid-mesh", "ValueError: device_mesh=(3, 2) holds 6 processes, but the world size is 2"),
        # Batches from a batch sampler of the script's own, which fabriclite cannot split between the ranks.
        (
            "unsplittable-batches",
            "ValueError: The DataLoader uses a custom batch_sampler (Chunks) without a `.sampler`",
        ),
    ],
    ids=["a-mesh-that-does-not-divide-the-world", "a-batch-that-cannot-split-between-the-ranks"],
)
def test_a_wrong_configuration_fails_in_the_plan_with_the_error_of_a_real_launch(config, expected):
    launch = run_python(
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", CONFIGS, config,
        timeout=TIMEOUT, check=False,
    )  # fmt: skip
    assert launch.returncode != 0 and expected in launch.stderr, launch.stderr[-3000:]
    planned = plan("--devices", "2", CONFIGS, config)
    assert planned["error"].startswith(expected) and planned["error_at_setup"]
    assert not planned["ok"] and planned["steps"] == 0


def test_a_tensor_parallel_plan_naming_a_missing_layer_shows_the_warning_of_a_real_launch_and_trains():
    launch = run_python("-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", CONFIGS,
                        "tp-missing-layer", timeout=TIMEOUT)  # fmt: skip
    warning = "Parallelize plan key 'gate' could not be resolved"
    assert warning in launch.stderr and "TRAINED 3" in launch.stdout
    planned = plan("--devices", "2", CONFIGS, "tp-missing-layer")
    assert any(warning in text for text in planned["warnings"])
    # The meshes FSDP2 builds inside fully_shard for tensor-parallel parameters are computed from real rank numbers.
    assert planned["error"] is None and planned["limit"] is None and planned["ok"] and planned["steps"] == 2


def test_a_configuration_that_trains_is_planned_to_its_second_step_and_fits():
    planned = plan("--devices", "2", "--device-memory", "1GiB", CONFIGS, "fine", check=True)
    assert planned["ok"] and planned["steps"] == 2 and planned["error"] is None and planned["limit"] is None
    # The same plan against a smaller device (no second process: Plan.ok reads the figures).
    too_small = Plan("plan_configs.py", 2, 2, 1, steps=2, device_memory=planned["peak_bytes"] - 1)
    too_small.memory, too_small.peak_bytes = planned["memory"], planned["peak_bytes"]
    too_small.setup_peak_bytes = planned["setup_peak_bytes"]
    assert not too_small.ok and "does NOT fit: 1 B over" in too_small.format()
    # Its batch is made in the script, not by a loader the plan could change: no search, and the plan says why.
    assert planned["batch"]["largest"] is None and "no loader with torch's BatchSampler" in planned["batch"]["note"]


def test_the_largest_micro_batch_that_fits_is_traced_and_a_real_run_at_it_peaks_within_10_percent():
    predicted = plan("--devices", "2", "--device-memory", "1MiB", CONFIGS, "fine", "16", check=True)
    batch = predicted["batch"]
    largest = batch["largest"]
    assert batch["script"] == 16 and largest > 16 and batch["first_over"] == largest + 1, batch
    rows = {row["batch"]: row for row in batch["traced"]}
    assert rows[largest]["peak_bytes"] <= 2**20 < rows[largest + 1]["peak_bytes"], rows
    # The same script given that batch, run for real on 2 gloo processes: each rank's peak as torch's profiler
    # counts it (this 2-process run has no kernels' scratch to speak of).
    for rank, peak in enumerate(measured_peaks(2, CONFIGS, "fine", str(largest))):
        assert abs(rows[largest]["peak_bytes"] - peak) <= 0.10 * peak, (rank, rows[largest], peak)
    too_small = plan("--devices", "2", "--device-memory", "100KiB", CONFIGS, "fine", "16")
    assert too_small["batch"]["largest"] == 0 and not too_small["ok"]
    assert too_small["batch"]["changes"][0].startswith("at batch 1 the peak is"), too_small["batch"]


def test_the_plan_command_refuses_bad_arguments_before_running_anything(tmp_path, capsys):
    for args, message in (
        (["--device-memory", "lots", CONFIGS, "fine"], "device memory 'lots' is not a size"),
        (["--devices", "auto", CONFIGS, "fine"], "a plan needs a count of processes per node"),
        ([str(tmp_path / "missing.py")], "does not exist"),
        ([], "no script to plan"),
        (["--devices", "2", "--num-nodes", "2", "--rank", "4", CONFIGS, "fine"], "--rank 4: expected a global rank"),
        (["--devices", "2", "--rank", "-1", CONFIGS, "fine"], "of the 2 x 1 processes planned, 0 to 1"),
    ):
        # In this process: the arguments are refused before a process group or a script would run.
        with pytest.raises(SystemExit) as stopped:
            cli(["plan", *args])
        stderr = capsys.readouterr().err
        assert stopped.value.code == 2 and message in stderr, (args, stderr)


def test_the_bytes_handed_to_collectives_in_a_step_and_the_checkpoint_per_rank_match_a_real_run(tmp_path):
    args = [GPT, "--strategy", "fsdp", "--eval-windows", "32", "--sample-tokens", "0"]
    predicted = plan("--devices", "2", *args, "--out-dir", str(tmp_path / "plan"), check=True)
    by_name = {row["collective"]: row for row in predicted["collectives"]}
    # FSDP2 under bf16-mixed: 5 units all-gather their bf16 shards in forward and again in backward, and
    # reduce-scatter their fp32 gradients once.
    assert by_name["all_gather"]["calls"] == 10 and by_name["all_gather"]["bytes_in"] == 2 * 2 * GPT_PARAMETERS // 2
    assert by_name["reduce_scatter"]["calls"] == 5 and by_name["reduce_scatter"]["bytes_in"] == 4 * GPT_PARAMETERS
    assert by_name["reduce_scatter"]["bytes_sent"] == 4 * GPT_PARAMETERS // 2  # (n - 1) / n of it, on a ring
    # What gloo itself records for the same step of a real run (its reduce-scatter all-reduces the whole input; the
    # plan does not see the few hundred bytes DTensor all-reduces inside an op while clipping the gradients).
    result = run_python(
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", str(SCRIPTS / "measure_memory.py"),
        *args, "--out-dir", str(tmp_path / "measured"), timeout=TIMEOUT,
    )  # fmt: skip
    sent = {(rank, name): int(n) for rank, name, n in re.findall(r"SENT (\d+) (\w+) (\d+)", result.stdout)}
    assert sent[("0", "all_gather")] == by_name["all_gather"]["bytes_in"], sent
    assert 0 <= sent[("0", "all_reduce")] - by_name["reduce_scatter"]["bytes_in"] <= 4 * 1024, sent
    # The checkpoint a real fabric.save writes at step 2: one file of shards per rank, within 10% of what the plan
    # says each rank writes (the files also hold the loader's position, the schedule, the random streams).
    run_python(
        "-m", "fabriclite.cli", "run", "--accelerator", "cpu", "--devices", "2", *args, "--max-steps", "2",
        "--save-every", "2", "--out-dir", str(tmp_path / "saved"), timeout=TIMEOUT,
    )  # fmt: skip
    checkpoint = predicted["checkpoint"]
    assert checkpoint["sharded"] and checkpoint["rank"] == checkpoint["total"] // 2
    for rank in (0, 1):
        written = (tmp_path / "saved" / "last.ckpt" / f"__{rank}_0.distcp").stat().st_size
        assert abs(written - checkpoint["rank"]) <= 0.10 * written, (rank, written, checkpoint)
    on_disk = sum(f.stat().st_size for f in (tmp_path / "saved" / "last.ckpt").iterdir())
    assert abs(on_disk - checkpoint["total"]) <= 0.10 * on_disk, (on_disk, checkpoint)


@pytest.mark.parametrize(
    "script, devices",
    [("06_fabric_fsdp.py", 2), ("05_fabric_ddp.py", 1), ("06_fabric_fsdp.py", 4)],
    ids=["fsdp-2-ranks", "ddp-1-rank", "fsdp-4-ranks"],
)
def test_the_vit_examples_are_planned_unchanged_within_10_percent_of_the_tensors_alive_in_a_real_run(
    tmp_path, script, devices
):
    # The numbered scripts load pretrained weights (examples/vit/pretrain.py --series, minutes): random ones here.
    vit = runpy.run_path(str(ROOT / "examples" / "vit" / "model.py"))
    model = vit["ViT"](replace(vit["SERIES_CONFIG"], num_classes=10))
    weights = tmp_path / "vit_series.pt"
    torch.save(model.state_dict(), weights)
    script = [str(ROOT / "examples" / "vit" / script), "--devices", str(devices), "--weights", str(weights)]
    predicted = plan("--devices", str(devices), *script, check=True)
    assert predicted["ok"] and predicted["steps"] == 2 and predicted["limit"] is None
    # Rank 0's parameters, fp32: all 4,747,530 under DDP; under FSDP2 its shard of each, which fully_shard splits
    # along the first dimension as torch.chunk does, rank 0 taking the first ceil(rows / n) rows.
    if "fsdp" in script[0]:
        assert predicted["configuration"]["FSDP units"].startswith("7: 6 x Block, the root")
        share = sum(math.ceil(p.shape[0] / devices) * p[0].numel() for p in model.parameters())
    else:
        assert predicted["configuration"]["strategy"] == f"DDPStrategy, {devices} processes on cpu"
        share = sum(p.numel() for p in model.parameters())
    assert predicted["memory"]["parameters"] == 4 * share
    alive, allocated = measured_steps_alive(devices, *script)
    figures = (predicted["peak_bytes"], alive, allocated)
    assert abs(predicted["peak_bytes"] - min(alive)) <= 0.10 * min(alive), figures
    # A rank whose gloo reduce-scatters finish late holds their inputs longer (about 8 MB more on rank 0 in 1 run
    # of 6 of FSDP2 on 2 ranks here, a loaded 2-core machine); the plan's collectives finish at once.
    assert all(0.80 * peak <= predicted["peak_bytes"] <= 1.10 * peak for peak in alive), figures


TALK = str(ROOT / "examples" / "vit" / "10_talk_vit_b16.py")
# torchvision's ViT-B/16 holds 86,567,656 parameters with its 1,000-class head (ViT_B_16_Weights' "num_params");
# the talk's 10-class head has 768 x 10 + 10 of them instead of 768 x 1,000 + 1,000. The examples' ViT at the
# talk's shape (what the script trains without torchvision's weights) holds exactly as many.
VIT_B16_PARAMETERS = 86_567_656 - (768 * 1000 + 1000) + (768 * 10 + 10)


def test_the_talks_vit_b16_script_is_planned_unchanged_at_full_size_on_4_ranks():
    # Its command for DDP on 4 GPUs, planned with --synthetic: random init and CIFAR-10-shaped data made in memory,
    # never a download (tests run offline); the talk's batch of 128 at 224x224, bf16-mixed, compiled, 4 workers.
    predicted = plan("--devices", "4", TALK, "--devices", "4", "--synthetic", check=True)
    assert predicted["ok"] and predicted["steps"] == 2 and predicted["error"] is None and predicted["limit"] is None
    config = predicted["configuration"]
    assert config["strategy"] == "DDPStrategy, 4 processes on cpu"
    assert config["precision"] == "bf16-mixed: forward computes in bfloat16"
    holds = f"{VIT_B16_PARAMETERS:,}"
    assert config["model"] == f"ViT, {holds} parameters; this rank holds {holds} (float32)"
    assert config["model compile"] == (
        "torch.compile, regional: 12 blocks compiled in place (12 x Block), one graph per block class, backend "
        "inductor; planned as eager ops"
    )
    memory = predicted["memory"]
    assert memory["parameters"] == memory["gradients"] == 4 * VIT_B16_PARAMETERS  # DDP: every rank holds all, fp32
    assert 2 * 4 * VIT_B16_PARAMETERS <= memory["optimizer state"] <= 2 * 4 * VIT_B16_PARAMETERS + 4 * 200
    # The synthetic data set every rank makes before training (50,000 + 10,000 uint8 3x32x32 images, int64 labels),
    # and the batches of 128 the 4 workers had handed over when the steps began (2 each at most, however they ran).
    sample = 3 * 32 * 32 + 8
    prefetched, rest = divmod(memory["other"] - (50_000 + 10_000) * sample, 128 * sample)
    assert rest == 0 and 0 <= prefetched <= 4 * 2, memory
    assert memory["activations and temporaries"] > 4 * memory["parameters"]  # 128 x 197 tokens a rank
    # DDP all-reduces every fp32 gradient once a step; rank 0 of a full checkpoint writes the weights and AdamW's.
    (reduce,) = predicted["collectives"]
    assert reduce["collective"] == "all_reduce" and reduce["bytes_in"] == 4 * VIT_B16_PARAMETERS
    checkpoint = predicted["checkpoint"]
    assert not checkpoint["sharded"] and checkpoint["rank"] == checkpoint["total"]
    assert 3 * 4 * VIT_B16_PARAMETERS <= checkpoint["total"] <= 3 * 4 * VIT_B16_PARAMETERS + 8 * 200


def test_the_talks_script_at_a_small_size_is_planned_within_10_percent_of_a_real_ddp_run_on_2_ranks():
    # Full size a real CPU step takes minutes: the script's own small options, eager (the plan traces compiled
    # code as eager ops), its loader in the main process, bf16-mixed as in the talk.
    small = ["--synthetic", "--image-size", "64", "--dim", "192", "--depth", "4", "--train-size", "256",
             "--test-size", "64", "--batch-size", "32", "--workers", "0", "--no-compile", "--devices", "2"]  # fmt: skip
    predicted = plan("--devices", "2", TALK, *small, check=True)
    assert predicted["ok"] and predicted["steps"] == 2
    assert predicted["configuration"]["model"].startswith("ViT, 1,932,874 parameters")
    allocated, alive = measured(2, TALK, *small)
    # Both ranks hold the same tensors (planned 61,677,132 bytes, alive 61,677,132 on both ranks in the real run,
    # the profiler 62,100,204 on both: 2026-11-29, 2-core CPU).
    figures = (predicted["peak_bytes"], alive, allocated)
    for peak in alive:
        assert abs(predicted["peak_bytes"] - peak) <= 0.10 * peak, figures
    # The profiler also counts scratch inside ops, which in the ViT's DDP runs overlapped the peak in some runs by
    # about one gradient bucket (here 7.7 MB, 12%) and in others not: the plan may be below it, not by much.
    for peak in allocated:
        assert 0.80 * peak <= predicted["peak_bytes"] <= 1.10 * peak, figures
