"""precision="fp8-mixed" (``Float8Precision``, torchao's float8 training layers) on the CPU under torchao's emulation,
and its refusals. DDP and FSDP on 2 gloo processes run tests/scripts/fp8_checks.py; Lightning's Transformer Engine
names are in test_transformer_engine.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from fabriclite import Fabric
from fabriclite._versions import torchao_float8, torchao_requirement
from fabriclite.choices import parse_precision
from helpers import SCRIPTS, assert_passed, run_python

torchao = pytest.importorskip("torchao", reason="fp8-mixed needs torchao (the dev extra installs it)")
from fabriclite.plugins import Float8Precision  # noqa: E402

Float8Linear = torchao.float8.float8_linear.Float8Linear


class Net(nn.Module):
    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.odd = nn.Linear(2 * width, 24)  # 24 is not a multiple of 16: stays in bf16
        self.down = nn.Linear(24, width)
        self.mid = nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.down(self.odd(torch.relu(self.up(x))))))


def fabric_with(precision: str | Float8Precision, **kwargs) -> Fabric:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the emulation notice on a CPU
        if isinstance(precision, str):
            return Fabric(accelerator="cpu", precision=precision, **kwargs)
        return Fabric(accelerator="cpu", plugins=[precision], **kwargs)


def run(precision: str | Float8Precision, seed: int = 0, **kwargs):
    """One forward and backward of ``Net`` on a fixed batch: (the model, its output, its weights' gradients)."""
    torch.manual_seed(seed)
    fabric = fabric_with(precision, **kwargs)
    model = fabric.setup(Net())
    x = torch.randn(64, 32)
    out = model(x)
    fabric.backward(out.pow(2).mean())
    return model, out.detach(), {n: p.grad for n, p in model.module.named_parameters()}


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_fp8_and_fp8_mixed_parse_to_fp8_mixed():
    assert parse_precision("fp8") == "fp8-mixed" == parse_precision("FP8-mixed")
    with pytest.raises(ValueError, match="Did you mean 'fp8-mixed'"):
        parse_precision("fp8-mixd")


def test_the_string_on_a_cpu_warns_that_it_emulates_and_builds_float8precision():
    with pytest.warns(UserWarning, match="on a CPU runs torchao's float8 emulation"):
        fabric = Fabric(accelerator="cpu", precision="fp8-mixed")
    precision = fabric._precision
    assert isinstance(precision, Float8Precision)
    assert (precision.emulate, precision.recipe, precision.name) == (True, "tensorwise", "fp8-mixed")


def test_eligible_linears_become_float8_the_head_and_odd_sizes_and_ignored_ones_stay():
    model, _, _ = run(Float8Precision(emulate=True))
    float8 = sorted(n for n, m in model.module.named_modules() if isinstance(m, Float8Linear))
    assert float8 == ["mid.0", "up"]  # odd (64 -> 24) and down (24 -> 32) are not multiples of 16; head is kept
    model, _, _ = run(Float8Precision(emulate=True, keep_head=False, ignore_modules={"mid"}))
    assert sorted(n for n, m in model.module.named_modules() if isinstance(m, Float8Linear)) == ["head", "up"]


def test_parameters_and_optimizer_state_stay_fp32_and_the_state_dict_keeps_the_plain_keys():
    torch.manual_seed(0)
    fabric = fabric_with(Float8Precision(emulate=True))
    plain = Net()
    model = Net()
    model.load_state_dict(plain.state_dict())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(model(torch.randn(4, 32)).pow(2).mean())
    optimizer.step()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(s["exp_avg"].dtype == torch.float32 for s in optimizer.state.values())
    assert len(optimizer.state) == len(list(model.parameters()))  # every weight stepped, the float8 ones too
    assert model.state_dict().keys() == plain.state_dict().keys()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_forward_and_backward_match_bf16_mixed_within_fp8_error_and_differ_from_it(recipe):
    _, reference, reference_grads = run("bf16-mixed")
    _, out, grads = run(Float8Precision(recipe, emulate=True))
    # e4m3 keeps 3 mantissa bits (relative rounding up to 1/16); over a few layers the error stays well below 10%.
    assert 1e-3 < relative_error(out, reference) < 0.1
    for name in ("up.weight", "mid.0.weight", "head.weight"):
        assert relative_error(grads[name], reference_grads[name]) < 0.15, name
    assert relative_error(grads["up.weight"], reference_grads["up.weight"]) > 1e-3  # fp8, not bf16, was used


def test_training_with_fp8_lowers_the_loss_with_gradient_clipping():
    torch.manual_seed(0)
    fabric = fabric_with(Float8Precision("rowwise", emulate=True))
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    x, y = torch.randn(32, 32), torch.randint(0, 16, (32,))
    losses, norms = [], []
    for _ in range(10):
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        norms.append(fabric.clip_gradients(model, optimizer, max_norm=0.5).item())
        clipped = torch.stack([p.grad.norm() for p in model.parameters()]).norm().item()
        assert clipped <= 0.5 + 1e-4
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert max(norms) > 0.5  # clipping did something


def test_a_checkpoint_of_an_fp8_model_loads_into_a_bf16_mixed_model_and_back(tmp_path):
    torch.manual_seed(0)
    fp8 = fabric_with(Float8Precision(emulate=True))
    model = fp8.setup(Net())
    fp8.save(tmp_path / "fp8.ckpt", {"model": model})
    bf16 = fabric_with("bf16-mixed")
    other = bf16.setup(Net())
    bf16.load(tmp_path / "fp8.ckpt", {"model": other})
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values()))
    assert not any(isinstance(m, Float8Linear) for m in other.modules())
    with torch.no_grad():
        other.module.up.weight.add_(1.0)
    bf16.save(tmp_path / "bf16.ckpt", {"model": other})
    again = fp8.setup(Net())
    fp8.load(tmp_path / "bf16.ckpt", {"model": again})
    assert torch.equal(again.module.up.weight, other.module.up.weight)
    assert isinstance(again.module.up, Float8Linear)


def test_init_module_and_empty_init_build_a_model_that_converts():
    fabric = fabric_with(Float8Precision(emulate=True))
    with fabric.init_module(empty_init=True):
        model = Net()
    model = fabric.setup(model)
    assert isinstance(model.module.up, Float8Linear)
    assert model(torch.randn(2, 32)).dtype == torch.float32


def test_a_model_the_user_converted_is_left_as_it_is():
    model = Net()
    config = torchao.float8.Float8LinearConfig(emulate=True)
    torchao.float8.convert_to_float8_training(model, config=config, module_filter_fn=lambda _, name: name == "up")
    precision = Float8Precision(emulate=True)
    fabric_with(precision).setup(model)
    assert precision.converted == ["up"] and not isinstance(model.mid[0], Float8Linear)


def test_a_lazy_linear_not_yet_run_stays_as_it_is():
    precision = Float8Precision(emulate=True)
    model = nn.Sequential(nn.LazyLinear(32), nn.Linear(32, 32), nn.Linear(32, 4))
    model = fabric_with(precision).setup(model)
    assert precision.converted == ["1"] and model(torch.randn(2, 16)).shape == (2, 4)


def test_a_model_without_an_eligible_linear_warns_that_it_trains_as_bf16():
    fabric = fabric_with(Float8Precision(emulate=True))
    with pytest.warns(UserWarning, match="found no Linear layer to run in float8 in Sequential"):
        fabric.setup(nn.Sequential(nn.Linear(10, 12), nn.ReLU(), nn.Linear(12, 2)))


def test_compile_runs_the_emulated_float8_layers_and_matches_eager():
    pytest.importorskip("torch._inductor")
    _, eager, _ = run(Float8Precision(emulate=True))
    _, compiled, grads = run(Float8Precision(emulate=True), compile=True)
    assert relative_error(compiled, eager) < 1e-2
    assert all(g is not None and torch.isfinite(g).all() for g in grads.values())


def test_without_compile_on_a_gpu_setup_warns_that_fp8_needs_it_and_on_a_cpu_it_does_not():
    precision = Float8Precision(emulate=True)
    fabric = fabric_with(precision)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fabric.setup(Net())
    precision.device_type, precision.emulate = "cuda", False  # what place() sets on an H100
    with pytest.warns(UserWarning, match="without compile=True: eager float8 layers"):
        fabric.setup(Net())


CHECKS = [
    "the blocks' Linear layers run in float8, the head stays",
    "float8 all-gather is on exactly when sharded with tensorwise scales",
    "parameters stay fp32",
    "the loss goes down",
    "the optimizer steps every parameter, the float8 weights too",
    "optimizer state stays fp32",
    "every rank holds the same weights",
]
FULL = ["the full checkpoint holds plain fp32 tensors", "the full checkpoint loads into an unconverted model"]
FSDP_ONLY = [
    "a sharded checkpoint loads back",
    "training goes on the same from a sharded checkpoint",
    "a sharded fp8 checkpoint loads into an unconverted model",
    "a sharded checkpoint of an unconverted model loads into an fp8 one",
    "an empty_init model is converted, filled in setup and trains",
]


@pytest.mark.parametrize(
    ("strategy", "recipe", "compile", "own"),
    [
        ("ddp", "tensorwise", "", ["no_backward_sync keeps each rank's own float8 gradients"]),
        # float8 all-gathers, the blocks compiled by Inductor (emulation compiles on the CPU)
        (
            "fsdp",
            "tensorwise",
            "compile",
            [
                *FSDP_ONLY,
                "the float8 blocks compile whole, once each",
                "the float8 weight scales are computed after each step",
            ],
        ),
        ("fsdp", "rowwise", "", FSDP_ONLY),  # bf16 all-gathers
    ],
)
def test_fp8_trains_and_checkpoints_on_two_gloo_processes(strategy, recipe, compile, own, tmp_path):
    args = [strategy, str(tmp_path), recipe, *([compile] if compile else [])]
    out = run_python(str(SCRIPTS / "fp8_checks.py"), *args, timeout=300).stdout
    assert_passed(out, CHECKS + FULL + own)


# ---------------------------------------------------------------------------------------------------- refusals
def test_a_cpu_without_emulation_is_refused_naming_emulate():
    with pytest.raises(ValueError, match=r"emulate=False\) on cpu: float8 matrix products run on CUDA GPUs"):
        Float8Precision(emulate=False, device="cpu")


def test_a_gpu_below_compute_capability_8_9_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(ValueError, match=r"NVIDIA A100-SXM4-80GB has compute capability 8\.0"):
        Float8Precision(device="cuda")
    assert Float8Precision(device="cuda", emulate=True).emulate  # emulation is allowed anywhere
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert Float8Precision(device="cuda").emulate is False


def test_bad_settings_are_refused_naming_the_value():
    with pytest.raises(ValueError, match=r"recipe='rowwize'.*Did you mean 'rowwise'"):
        Float8Precision("rowwize")
    with pytest.raises(ValueError, match="float8_all_gather=True\\) needs recipe='tensorwise'"):
        Float8Precision("rowwise", float8_all_gather=True)
    with pytest.raises(ValueError, match=r"names \['blocks'\], which Net does not have"):
        fabric_with(Float8Precision(emulate=True, ignore_modules={"blocks"})).setup(Net())
    with pytest.raises(ValueError, match="float8_all_gather=True\\) is for a sharded model"):
        fabric_with(Float8Precision(emulate=True, float8_all_gather=True)).setup(Net())


def test_a_missing_or_mismatched_torchao_is_refused_naming_the_versions_and_the_install(monkeypatch):
    assert torchao_requirement("2.13.0") == "torchao>=0.17.0"
    assert torchao_requirement("2.8.0+cpu") == "torchao>=0.13.0,<0.14.1"
    assert torchao_requirement("2.10.1") == "torchao>=0.16.0,<0.17.0"
    with pytest.raises(ImportError, match=r"built for torch 2\.13\.0, but torchao 0\.13\.0 .*'torchao>=0\.17\.0'"):
        torchao_float8(torchao_version="0.13.0", torch_version="2.13.0")
    with pytest.raises(ImportError, match=r"torch 2\.8\.0, but torchao 0\.18\.0 .*'torchao>=0\.13\.0,<0\.14\.1'"):
        torchao_float8(torchao_version="0.18.0", torch_version="2.8.0")
    assert torchao_float8(torchao_version="0.18.0+cpu", torch_version="2.13.0") is torchao.float8

    import importlib.metadata

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(
        ModuleNotFoundError,
        match=r"No module named 'torchao': precision='fp8-mixed' .*For torch .*pip install 'torchao",
    ):
        Fabric(accelerator="cpu", precision="fp8-mixed")
