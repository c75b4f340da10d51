"""fabriclite on a CUDA GPU: every precision, parity with raw PyTorch, the Triton kernels compiled for the GPU at LLM
shapes, compile with and without kernels, DDP and FSDP over nccl, DDP of two ranks on one GPU, and checkpoints moving
between CUDA and a CPU-only process.

Each check is written once (in cuda_checks.py, compiled_kernels.py or a script beside them) and runs twice: marked
``gpu`` on CUDA at full size (``python -m pytest -m gpu tests/cuda`` on a GPU machine; skipped elsewhere), and
unmarked on the CPU at a tiny size, so that its code runs in every test run. A CPU run proves the check works; only
the GPU run proves the GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from compiled_kernels import KERNEL_SHAPES, check_kernel
from cuda_checks import (
    PRECISIONS,
    check_inf_gradients_skip_the_step,
    check_loaded,
    check_parity,
    check_precision,
    checkpoint_state,
    tensors_of,
    train_a_step,
)
from helpers import assert_passed, run_python

from fabriclite import Fabric

HERE = Path(__file__).resolve().parent
CUDA, CPU = torch.device("cuda"), torch.device("cpu")
# The kernel checks compile the kernels for the GPU: Triton's interpreter off, whatever this process has set.
COMPILED = {"TRITON_INTERPRET": "0"}
KERNEL_CHECKS = [
    f"kernel {op} {'x'.join(map(str, shape))}" for op, shapes in KERNEL_SHAPES["llm"].items() for shape in shapes
]
TINY_KERNELS = [(op, shape) for op, shapes in KERNEL_SHAPES["tiny"].items() for shape in shapes]


def run_script(name: str, *args: str, timeout: float = 300, **env: str) -> str:
    """The output of ``python tests/cuda/<name> *args`` (stdout, then stderr), which must exit 0."""
    result = run_python(str(HERE / name), *args, timeout=timeout, check=False, **env)
    output = result.stdout + "\n" + result.stderr
    assert result.returncode == 0, f"{name} {' '.join(args)} exited {result.returncode}:\n{output[-4000:]}"
    return result.stdout


def needs_the_interpreter() -> None:
    pytest.importorskip("triton", reason="fabriclite's kernels are written in Triton")
    from fabriclite.kernels import kernels_available

    if not kernels_available("cpu"):
        pytest.skip("the kernels run on a CPU only under Triton's interpreter (TRITON_INTERPRET=1)")


# ---------------------------------------------------------------------- precisions
@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_precision_trains_on_cuda_in_its_dtypes(precision):
    check_precision(CUDA, precision)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_precision_check_runs_on_the_cpu(precision):
    check_precision(CPU, precision)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_the_fp16_scaler_skips_a_step_with_inf_gradients_on_cuda_and_the_next_step_applies(precision):
    check_inf_gradients_skip_the_step(CUDA, precision)


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_the_inf_gradient_check_runs_on_the_cpu(precision):
    check_inf_gradients_skip_the_step(CPU, precision)


# ---------------------------------------------------------------------- parity
@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fabric_ends_bit_identical_to_raw_pytorch_after_50_deterministic_steps_on_cuda(precision):
    check_parity(CUDA, precision)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_parity_check_runs_on_the_cpu(precision):
    check_parity(CPU, precision)


# ---------------------------------------------------------------------- kernels
@pytest.fixture(scope="module")
def kernels_at_llm_shapes():
    return run_script("compiled_kernels.py", "kernels", "cuda", "llm", timeout=600, **COMPILED)


@pytest.mark.gpu
@pytest.mark.timeout(660)  # the first one runs the fixture's child, which may take 600 s
@pytest.mark.parametrize("name", KERNEL_CHECKS)
def test_each_kernel_compiled_for_the_gpu_matches_torch_forward_and_backward_at_llm_shapes(kernels_at_llm_shapes, name):
    assert_passed(kernels_at_llm_shapes, [name], ranks=("0",))


@pytest.mark.parametrize(("op", "shape"), TINY_KERNELS, ids=[op for op, _ in TINY_KERNELS])
def test_the_kernel_check_runs_on_the_cpu_under_the_interpreter(op, shape):
    needs_the_interpreter()
    check_kernel(op, shape, CPU)


# ---------------------------------------------------------------------- compile
@pytest.mark.gpu
@pytest.mark.timeout(660)
def test_compile_true_with_and_without_kernels_trains_in_one_graph_without_breaks_on_cuda():
    pytest.importorskip("triton")
    output = run_script("compiled_kernels.py", "compile", "cuda", timeout=600, **COMPILED)
    assert_passed(output, ["compile kernels=False", "compile kernels=True"], ranks=("0",))


def test_the_compile_check_runs_on_the_cpu():
    needs_the_interpreter()
    output = run_script("compiled_kernels.py", "compile", "cpu", timeout=240)
    assert_passed(output, ["compile kernels=False", "compile kernels=True"], ranks=("0",))


# ---------------------------------------------------------------------- strategies
STRATEGY_CHECKS = ["process group", "trains like one device", "checkpoint round trip"]
TWO_RANK_CHECKS = [
    "two ranks share the device over gloo",
    "all_reduce and all_gather of device tensors",
    "each rank reads half the data",
    "DDP equals one process on the whole batch",
]


@pytest.mark.gpu
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_ddp_and_fsdp_train_and_checkpoint_at_world_size_one_over_nccl(strategy, tmp_path):
    output = run_script("strategy_world_one.py", strategy, "cuda", str(tmp_path), timeout=300)
    assert_passed(output, [f"{strategy} {name}" for name in STRATEGY_CHECKS], ranks=("0",))
    assert "nccl on cuda:0" in output


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_world_size_one_check_runs_on_the_cpu_over_gloo(strategy, tmp_path):
    output = run_script("strategy_world_one.py", strategy, "cpu", str(tmp_path), timeout=240)
    assert_passed(output, [f"{strategy} {name}" for name in STRATEGY_CHECKS], ranks=("0",))


@pytest.mark.gpu
def test_ddp_trains_on_two_processes_sharing_the_gpu_over_gloo():
    output = run_script("ddp_two_ranks_one_device.py", "cuda", timeout=300)
    assert_passed(output, TWO_RANK_CHECKS)


def test_the_two_ranks_on_one_device_check_runs_on_the_cpu():
    output = run_script("ddp_two_ranks_one_device.py", "cpu", timeout=240)
    assert_passed(output, TWO_RANK_CHECKS)


# ---------------------------------------------------------------------- checkpoints
def checkpoint_through_a_cpu_only_process(device: torch.device, folder: Path) -> None:
    """Save on ``device``, load in a process that sees no GPU, train a step there and save, load back on ``device``:
    every tensor arrives as saved, on the device that loads it, and training goes on."""
    fabric = Fabric(accelerator=device.type)
    state = checkpoint_state(fabric)
    for _ in range(2):
        train_a_step(fabric, state)
    fabric.save(folder / "saved.ckpt", state)
    torch.save(tensors_of(state), folder / "saved.expected")

    output = run_script(
        "checkpoint_on_cpu.py",
        *(str(folder / name) for name in ("saved.ckpt", "saved.expected", "cpu.ckpt")),
        timeout=180,
        CUDA_VISIBLE_DEVICES="",
    )
    assert "PASS 0 loaded on a process with CUDA available: False" in output, output

    back = checkpoint_state(fabric)
    fabric.load(folder / "cpu.ckpt", back)
    check_loaded(back, torch.load(folder / "cpu.ckpt.expected", weights_only=True), device, step=3)
    train_a_step(fabric, back)


@pytest.mark.gpu
def test_a_checkpoint_saved_on_cuda_loads_in_a_cpu_only_process_and_back_on_cuda(tmp_path):
    checkpoint_through_a_cpu_only_process(CUDA, tmp_path)


def test_the_checkpoint_check_runs_on_the_cpu(tmp_path):
    checkpoint_through_a_cpu_only_process(CPU, tmp_path)


# ---------------------------------------------------------------------- Lightning's device behaviour
@pytest.mark.gpu
def test_a_model_on_cpu_and_cuda_warns_in_setup_and_ends_on_the_strategy_s_device():
    # The CPU twin (a meta parameter, the only second device a CPU has) is in tests/test_lightning_names.py.
    from fabriclite.strategies import SingleDeviceStrategy
    from fabriclite.utilities.warnings import PossibleUserWarning

    last = torch.device("cuda", torch.cuda.device_count() - 1)
    fabric = Fabric(accelerator="cuda", strategy=SingleDeviceStrategy(device=last))
    model = torch.nn.Sequential(torch.nn.Linear(1, 2), torch.nn.Linear(2, 2, device=CUDA))
    match = rf"has 2 parameters on different devices \(for example '1.weight' on {CUDA}:0 and '0.weight' on cpu\)"
    with pytest.warns(PossibleUserWarning, match=match):
        wrapped = fabric.setup(model)
    assert fabric.device == wrapped.device == last
    assert {p.device for p in model.parameters()} == {last}
