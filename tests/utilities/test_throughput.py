"""fabriclite.utilities.throughput: rates over a window, FLOPs counted on the meta device, MFU, logging."""

import csv

import pytest
import torch
from torch import nn

from fabriclite import Fabric
from fabriclite.loggers import CSVLogger
from fabriclite.utilities.throughput import Throughput, ThroughputMonitor, measure_flops, peak_flops


def test_rates_are_the_change_over_the_window_per_second():
    throughput = Throughput(available_flops=100.0, world_size=2, window_size=3)
    throughput.update(time=1.0, batches=1, samples=4, lengths=40, flops=10)
    assert throughput.compute() == {"time": 1.0, "batches": 1, "samples": 4, "lengths": 40}
    throughput.update(time=2.0, batches=2, samples=8, lengths=80, flops=20)
    throughput.update(time=3.0, batches=3, samples=12, lengths=120, flops=30)
    throughput.update(time=5.0, batches=4, samples=16, lengths=160, flops=40)  # the window now starts at t=2
    metrics = throughput.compute()
    assert metrics["device/batches_per_sec"] == pytest.approx(2 / 3) and metrics["batches_per_sec"] == pytest.approx(
        4 / 3
    )
    assert metrics["device/samples_per_sec"] == pytest.approx(8 / 3) and metrics["samples_per_sec"] == pytest.approx(
        16 / 3
    )
    assert metrics["device/items_per_sec"] == pytest.approx(80 / 3) and metrics["items_per_sec"] == pytest.approx(
        160 / 3
    )
    # FLOPs of the updates after the window's first: 30 + 40 in 3 s.
    assert metrics["device/flops_per_sec"] == pytest.approx(70 / 3) and metrics["flops_per_sec"] == pytest.approx(
        140 / 3
    )
    assert metrics["device/mfu"] == pytest.approx(70 / 3 / 100) and "mfu" not in metrics  # Lightning has no global one
    throughput.reset()
    assert throughput.compute() == {}


def test_one_device_reports_no_totals_across_devices_and_no_mfu_without_a_peak():
    throughput = Throughput(window_size=2)
    throughput.update(time=0.5, batches=1, samples=2, flops=5)
    throughput.update(time=1.0, batches=2, samples=4, flops=5)
    metrics = throughput.compute()
    assert metrics["device/samples_per_sec"] == 4 and metrics["device/flops_per_sec"] == 10
    assert not {"samples_per_sec", "flops_per_sec", "device/mfu", "mfu"} & set(metrics)


@pytest.mark.parametrize(
    ("update", "error", "message"),
    [
        ({"time": 0.5, "batches": 3, "samples": 8}, ValueError, r"time=0.5 after time=1.0"),
        ({"time": 1.0, "batches": 3, "samples": 8}, ValueError, r"time=1.0 after time=1.0"),
        ({"time": 2.0, "batches": 1, "samples": 8}, ValueError, r"batches=1 after batches=2"),
        (
            {"time": 2.0, "batches": 3, "samples": 2},
            ValueError,
            r"samples \(2\) to be greater or equal than batches \(3\)",
        ),
        (
            {"time": 2.0, "batches": 3, "samples": 8, "lengths": 9},
            RuntimeError,
            "pass lengths at every update or never",
        ),
    ],
)
def test_updates_that_are_not_running_totals_are_refused(update, error, message):
    throughput = Throughput()
    throughput.update(time=1.0, batches=2, samples=4)
    with pytest.raises(error, match=message):
        throughput.update(**update)
    assert throughput.compute()["time"] == 1.0  # the refused update left nothing behind


def test_flops_are_counted_on_the_meta_device_forward_and_backward():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 10))
        x = torch.randn(8, 64)
    forward = 2 * 8 * (64 * 128 + 128 * 10)
    assert measure_flops(model, lambda: model(x)) == forward
    # Backward: the weight gradient of both layers, the input gradient of the second (x needs none).
    step = measure_flops(model, lambda: model(x), lambda y: y.sum())
    assert step == forward + 2 * 8 * (64 * 128 + 128 * 10) + 2 * 8 * 128 * 10
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize(
    ("name", "dtype", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4e12),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756e12),
        ("NVIDIA H100 NVL", torch.bfloat16, 835.5e12),
        ("NVIDIA H200", "tf32", 494.7e12),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312e12),
        ("NVIDIA A100 80GB PCIe", torch.float32, 19.5e12),
        ("NVIDIA L40S", torch.bfloat16, 362e12),
        ("NVIDIA L4", torch.bfloat16, 121e12),
        ("NVIDIA A10G", torch.bfloat16, None),  # not the A10: not in the table
        ("Tesla T4", torch.bfloat16, None),  # no bf16 tensor cores
    ],
)
def test_the_peak_is_the_dense_figure_of_the_gpu_named(name, dtype, peak):
    assert peak_flops(name, dtype) == peak


def test_the_monitor_logs_rates_and_mfu_through_the_fabric(tmp_path):
    fabric = Fabric(accelerator="cpu", loggers=CSVLogger(tmp_path, name="run", version=0))
    monitor = ThroughputMonitor(fabric, window_size=2)
    assert monitor.available_flops is None  # a CPU has no peak to compare with
    monitor = ThroughputMonitor(fabric, available_flops=1000.0, window_size=2)
    for i in range(1, 4):
        monitor.update(time=float(i), batches=i, samples=4 * i, flops=100)
        monitor.compute_and_log()
    fabric.loggers[0].finalize("success")
    rows = list(csv.DictReader(open(tmp_path / "run" / "version_0" / "metrics.csv")))
    assert [row["step"] for row in rows] == ["0", "1", "2"]
    assert float(rows[-1]["device/samples_per_sec"]) == 4 and float(rows[-1]["device/mfu"]) == pytest.approx(0.1)


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
def test_the_rates_wait_until_the_window_is_full(root):
    import importlib

    if root != "fabriclite":
        pytest.importorskip(root)
    meter = importlib.import_module(root + ".utilities.throughput").Throughput(window_size=3)
    for i in (1, 2):
        meter.update(time=float(i), batches=i, samples=4 * i, flops=10)
        assert set(meter.compute()) == {"time", "batches", "samples"}
    meter.update(time=3.0, batches=3, samples=12, flops=10)
    assert meter.compute()["device/samples_per_sec"] == 4 and meter.compute()["device/flops_per_sec"] == 10


@pytest.mark.parametrize("root", ["fabriclite", "lightning.fabric"])
def test_the_keys_across_devices_are_lightnings_with_no_global_mfu(root):
    import importlib

    if root != "fabriclite":
        pytest.importorskip(root)
    meter = importlib.import_module(root + ".utilities.throughput").Throughput(
        available_flops=100.0, world_size=2, window_size=2
    )
    meter.update(time=1.0, batches=1, samples=4, lengths=40, flops=10)
    meter.update(time=2.0, batches=2, samples=8, lengths=80, flops=20)
    assert set(meter.compute()) == {
        "time", "batches", "samples", "lengths",
        "device/batches_per_sec", "device/samples_per_sec", "device/items_per_sec", "device/flops_per_sec",
        "device/mfu", "batches_per_sec", "samples_per_sec", "items_per_sec", "flops_per_sec",
    }  # fmt: skip


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_peak_patched_at_lightnings_path_gives_the_monitors_mfu(world_size):
    # Lightning's test_throughput_monitor and test_throughput_monitor_world_size patch get_available_flops at the
    # utilities path; the monitor looked it up in the module that defines it, and reported no MFU on a CPU.
    from unittest import mock

    logger = mock.Mock()
    fabric = Fabric(accelerator="cpu", devices=1, loggers=logger)
    with mock.patch("fabriclite.utilities.throughput.get_available_flops", return_value=100):
        monitor = ThroughputMonitor(fabric, window_size=4)
    monitor.world_size = world_size  # as if there were more devices
    for step in range(1, 6):  # a step a second, 3 samples of 2 items each, 10 FLOPs per device
        monitor.update(time=step + 0.5, batches=step, samples=3 * step, lengths=6 * step, flops=10)
        monitor.compute_and_log()
    logged = [c.kwargs["metrics"] for c in logger.log_metrics.mock_calls]
    assert [("device/mfu" in metrics) for metrics in logged] == [False, False, False, True, True]
    for metrics in logged[3:]:
        assert metrics["device/mfu"] == pytest.approx(0.1) and metrics["device/flops_per_sec"] == pytest.approx(10)
        assert metrics["device/items_per_sec"] == pytest.approx(6)
        assert metrics.get("flops_per_sec") == (pytest.approx(20) if world_size == 2 else None)


def test_the_monitor_counts_on_rank_zero_as_rank_zero_only_knows_it(monkeypatch):
    # Lightning's test_throughput_monitor_step gives the monitor a Mock for the Fabric: a Mock's global_rank is no 0,
    # so the monitor counted nothing; Lightning gates on rank_zero_only, as here.
    from unittest import mock

    from fabriclite.rank_zero import rank_zero_only
    from fabriclite.plugins import Precision

    fabric = mock.Mock(world_size=1)
    fabric.strategy.precision = Precision()
    monitor = ThroughputMonitor(fabric)
    monitor.update(time=0.5, batches=1, samples=3)
    assert monitor.compute_and_log() == {"time": 0.5, "batches": 1, "samples": 3}
    assert fabric.log_dict.mock_calls == [mock.call(metrics={"time": 0.5, "batches": 1, "samples": 3}, step=0)]
    monkeypatch.setattr(rank_zero_only, "_rank", 1)  # as a parallel strategy sets it on rank 1
    monitor.update(time=1.5, batches=2, samples=6)
    assert monitor.compute_and_log() == {}
