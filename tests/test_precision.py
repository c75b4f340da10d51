import json
import warnings
from importlib.util import find_spec

import numpy as np
import pytest
import torch
from torch import nn

import fabriclite.plugins.precision as precision_module
from fabriclite import Fabric
from fabriclite.plugins.precision import select_precision
from helpers import run_python


def tiny():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def cpu_fabric(precision):
    """A CPU Fabric in ``precision``; "16-mixed" through the plugin, since the string means bf16 on a CPU."""
    if precision == "16-mixed":
        return Fabric(accelerator="cpu", plugins=[precision_module.MixedPrecision("16-mixed", "cpu")])
    return Fabric(accelerator="cpu", precision=precision)


def setup(precision, model=None):
    fabric = cpu_fabric(precision)
    model = model or tiny()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped_model, wrapped_opt = fabric.setup(model, optimizer)
    return fabric, wrapped_model, wrapped_opt


@pytest.mark.torch_versions
def test_bf16_mixed_runs_the_forward_under_autocast_and_returns_fp32():
    _, model, _ = setup("bf16-mixed")
    seen = []
    model.module[0].register_forward_hook(lambda mod, args, out: seen.append(out.dtype))
    out = model(torch.randn(3, 4))
    assert seen == [torch.bfloat16]
    assert out.dtype == torch.float32
    assert model.module[0].weight.dtype == torch.float32  # master weights stay fp32


class _Tagged(torch.Tensor):
    """A tensor subclass, as a model's output may be one (a DTensor under tensor parallelism)."""


class _TaggedOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x):
        return {"logits": self.linear(x).as_subclass(_Tagged)}


def test_an_output_of_a_tensor_subclass_is_cast_like_a_tensor():
    # It recursed until RecursionError: the collection walk handed the subclass back to the same cast.
    _, model, _ = setup("bf16-mixed", _TaggedOutput())
    logits = model(torch.randn(3, 4))["logits"]
    assert type(logits) is _Tagged and logits.dtype == torch.float32


def test_32_true_leaves_everything_in_fp32():
    _, model, _ = setup("32-true")
    assert model(torch.randn(3, 4)).dtype == torch.float32


@pytest.mark.parametrize(
    ("name", "dtype"), [("bf16-true", torch.bfloat16), ("16-true", torch.float16), ("64-true", torch.float64)]
)
@pytest.mark.torch_versions
def test_true_precisions_convert_weights_and_inputs(name, dtype):
    _, model, _ = setup(name)
    seen = []
    model.module[0].register_forward_hook(lambda mod, args, out: seen.append((args[0].dtype, out.dtype)))
    out = model(torch.randn(3, 4))
    assert model.module[0].weight.dtype == dtype
    assert seen == [(dtype, dtype)]
    assert out.dtype == torch.float32


class ExpectsDtype(nn.Module):
    """Records the dtype of the input its forward receives, and whether autocast is on there."""

    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.seen = []

    def forward(self, x, scale=None):
        self.seen.append((x.dtype, None if scale is None else scale.dtype, torch.is_autocast_enabled("cpu")))
        return self.layer(x)


@pytest.mark.torch_versions
@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", torch.bfloat16), ("16-mixed", torch.float16)])
def test_mixed_precision_casts_floating_inputs_to_the_autocast_dtype(precision, dtype):
    fabric = cpu_fabric(precision)
    module = ExpectsDtype()
    model = fabric.setup(module)
    ids = torch.arange(3)
    out = model(torch.rand(3, 4), scale=torch.ones(1, dtype=torch.float64))
    assert module.seen == [(dtype, dtype, True)]
    assert out.dtype == torch.float32
    assert model.module.layer(torch.rand(1, 4)).dtype == torch.float32  # only the forward's inputs, not the weights
    assert fabric._precision.convert_input(((ids,), {})) == ((ids,), {})  # integers stay as they are


def test_a_float64_batch_from_numpy_trains_under_bf16_mixed():
    fabric = cpu_fabric("bf16-mixed")
    module = nn.Linear(4, 2)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    before = module.weight.detach().clone()
    batch = torch.from_numpy(np.random.default_rng(0).random((8, 4)))  # float64
    fabric.backward(model(batch).pow(2).mean())
    optimizer.step()
    assert module.weight.dtype == torch.float32 and not torch.equal(module.weight, before)


def test_16_mixed_on_cpu_warns_in_lightnings_words_and_becomes_bf16_mixed():
    with pytest.warns(
        UserWarning,
        match=r"precision='16-mixed'\)` but AMP with fp16 is not supported on CPU. Using `precision='bf16-mixed'",
    ):
        fabric = Fabric(accelerator="cpu", precision="16-mixed")
    assert fabric._precision.name == "bf16-mixed" and fabric._precision.scaler is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plugin = Fabric(accelerator="cpu", plugins=[precision_module.MixedPrecision("16-mixed", "cpu")])._precision
    assert plugin.name == "16-mixed" and plugin.scaler is not None  # a plugin is taken as given, as in Lightning


def emulation_warnings(monkeypatch, native, **fabric_args):
    """The warnings about emulated bf16 that ``Fabric(accelerator="cpu", **fabric_args)`` gives, the CPU probe
    answering ``native`` (this machine has AVX-512 BF16: the other answer stands for an AVX2-only CPU)."""
    monkeypatch.setattr("fabriclite.accelerators.cpu_has_native_bf16", lambda: native)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Fabric(accelerator="cpu", **fabric_args)
    return [str(w.message) for w in caught if "emulated" in str(w.message)]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-mixed"])
def test_bf16_on_a_cpu_without_native_bf16_warns_once_with_the_cost_and_what_to_use(monkeypatch, precision):
    said = emulation_warnings(monkeypatch, False, precision=precision)
    name = "bf16-true" if precision == "bf16-true" else "bf16-mixed"  # "16-mixed" becomes bf16-mixed on a CPU
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith(f"precision={name!r} is emulated on this CPU, which has no native bfloat16"), said
    assert "43 s against 13.6 s" in said[0] and "Pass precision='32-true'" in said[0]


@pytest.mark.parametrize("native, precision", [(True, "bf16-mixed"), (True, "bf16-true"), (False, "32-true")])
def test_a_cpu_with_native_bf16_or_fp32_gets_no_word_about_emulation(monkeypatch, native, precision):
    assert emulation_warnings(monkeypatch, native, precision=precision) == []


def test_the_cpu_probe_agrees_with_the_flags_linux_reports():
    # torch's CPUID probe (where this torch has it) and the kernel's /proc/cpuinfo are two views of one CPU.
    from fabriclite import accelerators

    flags = accelerators._cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo here")
    assert accelerators.cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


# Run under either implementation, in a process of its own (importing Lightning patches torch.compile).
_MIXED_PRECISION_ON_CPU = """
import json, sys, warnings
import numpy as np, torch
if sys.argv[1] == "lightning":
    from lightning.fabric import Fabric
else:
    from fabriclite import Fabric
seen = []
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
    def forward(self, x):
        seen.append(str(x.dtype))
        return self.layer(x)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fabric = Fabric(accelerator="cpu", devices=1, precision="16-mixed")
net = Net()
model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
out = model(torch.from_numpy(np.ones((2, 4))))
fabric.backward(out.sum())
optimizer.step()
print(json.dumps({"seen": seen, "out": str(out.dtype), "weight": str(net.layer.weight.dtype),
                  "warned": any("AMP with fp16 is not supported on CPU" in str(w.message) for w in caught)}))
"""


@pytest.mark.parametrize("implementation", ["fabriclite", "lightning"])
def test_16_mixed_on_cpu_trains_a_float64_batch_in_bf16_as_lightning_does(implementation):
    if implementation == "lightning" and find_spec("lightning") is None:
        pytest.skip("lightning is not installed; the fabriclite run states the same expectations")
    out = run_python("-c", _MIXED_PRECISION_ON_CPU, implementation, timeout=180).stdout
    result = json.loads(out.strip().splitlines()[-1])
    expected = {"seen": ["torch.bfloat16"], "out": "torch.float32", "weight": "torch.float32", "warned": True}
    assert result == expected


def test_bf16_on_a_cuda_device_without_bf16_suggests_16_mixed(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ValueError, match="16-mixed"):
        select_precision("bf16-mixed", torch.device("cuda", 0))


@pytest.mark.torch_versions
@pytest.mark.parametrize("name", ["16-mixed", "16-true"])
def test_the_scaler_skips_a_step_with_inf_gradients_and_backs_off(name):
    fabric, model, optimizer = setup(name)
    scaler = fabric._precision.scaler
    assert scaler is not None
    start_scale = scaler.get_scale()
    before = [p.detach().clone() for p in model.parameters()]

    loss = model(torch.randn(3, 4)).float().sum() * float("inf")  # injected overflow
    fabric.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "the step must be skipped"
    assert scaler.get_scale() == start_scale * 0.5

    fabric.backward(model(torch.randn(3, 4)).float().mean())
    optimizer.step()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "a finite step must apply"
    assert scaler.get_scale() == start_scale * 0.5


def test_the_scale_grows_after_growth_interval_good_steps():
    fabric, model, optimizer = setup("16-mixed")
    scaler = fabric._precision.scaler
    state = scaler.state_dict()
    state["_growth_tracker"] = state["growth_interval"] - 1
    scaler.load_state_dict(state)
    scale = scaler.get_scale()
    fabric.backward(model(torch.randn(3, 4)).mean())
    optimizer.step()
    assert scaler.get_scale() == scale * 2


@pytest.mark.torch_versions
def test_16_mixed_scales_the_loss_on_backward():
    fabric, model, optimizer = setup("16-mixed")
    reference = tiny()
    x = torch.randn(3, 4)
    reference(x).mean().backward()
    fabric.backward(model(x).mean())
    scale = fabric._precision.scaler.get_scale()
    grad = model.module[2].bias.grad
    assert torch.allclose(grad / scale, reference[2].bias.grad, rtol=1e-2, atol=1e-3)


def test_backward_with_a_loss_scaler_before_setup_is_refused():
    fabric = cpu_fabric("16-mixed")
    loss = tiny()(torch.randn(2, 4)).sum()
    with pytest.raises(RuntimeError, match="fabric.setup"):
        fabric.backward(loss)


def test_backward_without_a_scaler_works_before_setup():
    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    model = tiny()
    fabric.backward(model(torch.randn(2, 4)).sum())
    assert model[0].weight.grad is not None


def test_clip_gradients_by_norm_returns_the_total_norm_and_clips():
    fabric, model, optimizer = setup("32-true")
    fabric.backward(model(torch.randn(5, 4)).pow(2).sum() * 100)
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    norm = fabric.clip_gradients(model, optimizer, max_norm=0.5)
    assert torch.allclose(norm, expected)
    after = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert after == pytest.approx(0.5, rel=1e-4)


def test_clip_gradients_by_value_clamps_each_gradient():
    fabric, model, optimizer = setup("32-true")
    fabric.backward(model(torch.randn(5, 4)).pow(2).sum() * 100)
    assert fabric.clip_gradients(model, optimizer, clip_val=0.01) is None
    assert max(p.grad.abs().max().item() for p in model.parameters()) <= 0.01


@pytest.mark.torch_versions
def test_clip_gradients_unscales_first_under_16_mixed():
    fabric, model, optimizer = setup("16-mixed")
    reference = tiny()
    x = torch.randn(5, 4)
    reference(x).mean().backward()
    expected = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in reference.parameters()]))
    fabric.backward(model(x).mean())
    norm = fabric.clip_gradients(model, optimizer, max_norm=1e9)
    assert torch.allclose(norm, expected, rtol=1e-2)


def test_clip_gradients_with_inf_raises_in_fp32_but_lets_the_scaler_skip_in_fp16():
    fabric, model, optimizer = setup("32-true")
    fabric.backward(model(torch.randn(2, 4)).sum() * float("inf"))
    with pytest.raises(RuntimeError, match="non-finite"):
        fabric.clip_gradients(model, optimizer, max_norm=1.0)

    fabric, model, optimizer = setup("16-mixed")
    before = [p.detach().clone() for p in model.parameters()]
    fabric.backward(model(torch.randn(2, 4)).sum() * float("inf"))
    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0)
    assert not torch.isfinite(norm)
    optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("kwargs", [{}, {"clip_val": 1.0, "max_norm": 1.0}])
def test_clip_gradients_needs_exactly_one_of_clip_val_and_max_norm(kwargs):
    fabric, model, optimizer = setup("32-true")
    with pytest.raises(ValueError, match="exactly one"):
        fabric.clip_gradients(model, optimizer, **kwargs)


def test_autocast_context_applies_the_precision_outside_the_model():
    fabric = Fabric(accelerator="cpu", precision="bf16-mixed")
    with fabric.autocast():
        out = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert out.dtype == torch.bfloat16


def test_init_module_builds_in_the_precision_dtype_and_empty_init_skips_init():
    fabric = Fabric(accelerator="cpu", precision="bf16-true")
    with fabric.init_module():
        layer = nn.Linear(4, 4)
    assert layer.weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32

    tensor = torch.zeros(3)
    with Fabric(accelerator="cpu").init_module(empty_init=True):
        nn.init.constant_(tensor, 5.0)
    assert torch.equal(tensor, torch.zeros(3))
    with Fabric(accelerator="cpu").init_module(empty_init=False):
        nn.init.constant_(tensor, 5.0)
    assert torch.equal(tensor, torch.full((3,), 5.0))


def test_init_tensor_uses_the_precision_dtype():
    fabric = Fabric(accelerator="cpu", precision="64-true")
    with fabric.init_tensor():
        t = torch.ones(2)
    assert t.dtype == torch.float64


@pytest.mark.torch_versions
def test_scaler_state_is_saved_and_restored(tmp_path):
    fabric, model, optimizer = setup("16-mixed")
    fabric.backward(model(torch.randn(2, 4)).sum() * float("inf"))
    optimizer.step()
    scale = fabric._precision.scaler.get_scale()
    fabric.save(tmp_path / "c.ckpt", {"model": model, "optimizer": optimizer})
    fresh, fresh_model, fresh_opt = setup("16-mixed")
    assert fresh._precision.scaler.get_scale() != scale
    fresh.load(tmp_path / "c.ckpt", {"model": fresh_model, "optimizer": fresh_opt})
    assert fresh._precision.scaler.get_scale() == scale


def setup_with_plugin(plugin):
    fabric = Fabric(accelerator="cpu", plugins=[plugin])
    model = tiny()
    return fabric, *fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def non_finite_steps(fabric, model, optimizer, steps):
    for _ in range(steps):
        fabric.backward(model(torch.randn(3, 4)).float().sum() * float("inf"))
        optimizer.step()
        optimizer.zero_grad()


@pytest.mark.parametrize("plugin", [precision_module.MixedPrecision, precision_module.TruePrecision])
def test_a_long_run_of_non_finite_steps_stops_the_scale_at_its_floor_and_never_writes_nan(plugin):
    name = "16-mixed" if plugin is precision_module.MixedPrecision else "16-true"
    fabric, model, optimizer = setup_with_plugin(plugin(name, torch.device("cpu"), max_skipped_steps=None))
    non_finite_steps(fabric, model, optimizer, 170)  # a plain GradScaler halves its scale to exactly 0.0 by now
    assert fabric._precision.scaler.get_scale() == 2.0**-16
    fabric.backward(model(torch.randn(3, 4)).float().mean())
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_too_many_non_finite_steps_in_a_row_stop_the_run_saying_why():
    plugin = precision_module.MixedPrecision("16-mixed", torch.device("cpu"), max_skipped_steps=5)
    fabric, model, optimizer = setup_with_plugin(plugin)
    non_finite_steps(fabric, model, optimizer, 4)
    fabric.backward(model(torch.randn(3, 4)).float().mean())  # a finite step starts the count again
    optimizer.step()
    non_finite_steps(fabric, model, optimizer, 4)
    with pytest.raises(FloatingPointError, match="inf or NaN for 5 optimizer steps in a row.*bf16-mixed"):
        non_finite_steps(fabric, model, optimizer, 1)


def test_the_count_of_skipped_steps_travels_in_the_precision_state():
    fabric, model, optimizer = setup("16-mixed")
    non_finite_steps(fabric, model, optimizer, 3)
    state = fabric._precision.state_dict()
    assert state["skipped_in_a_row"] == 3
    fresh = precision_module.MixedPrecision("16-mixed", torch.device("cpu"))
    fresh.load_state_dict(state)
    assert fresh.scaler.skipped_in_a_row == 3 and fresh.scaler.get_scale() == fabric._precision.scaler.get_scale()


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"min_scale": 0}, "min_scale=0 must be a number > 0"),
    ({"max_skipped_steps": 0}, "max_skipped_steps=0 must be an int >= 1, or None"),
    ({"max_skipped_steps": 2.5}, "max_skipped_steps=2.5 must be an int"),
])  # fmt: skip
def test_invalid_scaler_limits_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        precision_module.MixedPrecision("16-mixed", torch.device("cpu"), **kwargs)


def _train_weights(**fabric_kwargs):
    torch.manual_seed(0)
    fabric = Fabric(accelerator="cpu", **fabric_kwargs)
    module = nn.Linear(4, 2)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for step in range(3):
        loss = model(torch.full((3, 4), step + 1.0)).float().pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return fabric, model.module.weight.detach()


@pytest.mark.parametrize(
    ("plugin", "name"),
    [
        (lambda p: p.HalfPrecision("bf16-true"), "bf16-true"),
        (lambda p: p.DoublePrecision(), "64-true"),
        (lambda p: p.MixedPrecision("bf16-mixed", "cpu"), "bf16-mixed"),
        (lambda p: p.FSDPPrecision("bf16-mixed"), "bf16-mixed"),
        (lambda p: p.FSDPPrecision("32-true"), "32-true"),
    ],
)
@pytest.mark.torch_versions
def test_lightnings_precision_plugins_train_as_the_precision_they_name(plugin, name):
    import fabriclite.plugins as plugins

    fabric, weights = _train_weights(plugins=[plugin(plugins)])
    _, expected = _train_weights(precision=name)
    assert fabric._precision.name == name
    assert weights.dtype == expected.dtype and torch.equal(weights, expected)


def test_half_precision_built_without_a_device_gets_its_scaler_from_the_fabric():
    from fabriclite.plugins import HalfPrecision

    plugin = HalfPrecision()  # "16-true", as Lightning's default
    assert plugin.scaler is None
    fabric = Fabric(accelerator="cpu", plugins=[plugin])
    assert fabric._precision is plugin and plugin.scaler is not None and plugin.scaler._device == "cpu"


def test_precision_plugins_refuse_names_and_scalers_they_do_not_take():
    from fabriclite.plugins import FSDPPrecision, HalfPrecision, MixedPrecision

    with pytest.raises(
        ValueError, match="HalfPrecision\\(precision='bf16-mixed'\\) is not supported. Valid: 'bf16-true'"
    ):
        HalfPrecision("bf16-mixed")
    with pytest.raises(ValueError, match="precision='bf16-mixed' does not use one"):
        MixedPrecision("bf16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="FSDPPrecision\\(precision='8-true'\\) is not supported"):
        FSDPPrecision("8-true")
    scaler = torch.amp.GradScaler("cpu")
    assert MixedPrecision("16-mixed", "cpu", scaler=scaler).scaler is scaler


def test_a_true_fp16_precision_refuses_at_construction_a_scaler_that_cannot_unscale_fp16_gradients():
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from fabriclite.plugins import FSDPPrecision, HalfPrecision

    # Before, accepted; the first step then failed with "Attempting to unscale FP16 gradients".
    for build in (FSDPPrecision, HalfPrecision):
        with pytest.raises(ValueError, match=r"precision=.16-true. with scaler=GradScaler.*Pass a .*ShardedGradScaler"):
            build("16-true", scaler=torch.amp.GradScaler("cpu"))
    sharded, off = ShardedGradScaler("cpu"), torch.amp.GradScaler("cpu", enabled=False)
    assert FSDPPrecision("16-true", scaler=sharded).scaler is sharded
    assert HalfPrecision("16-true", scaler=off).scaler is off  # a disabled scaler never unscales
    plain = torch.amp.GradScaler("cpu")
    assert FSDPPrecision("16-mixed", scaler=plain).scaler is plain  # fp32 weights: fp32 gradients to unscale


def test_the_users_scaler_is_the_one_that_steps_and_its_state_is_what_a_checkpoint_holds(tmp_path):
    user = torch.amp.GradScaler("cpu", init_scale=1024.0)
    fabric = Fabric(accelerator="cpu", plugins=[precision_module.MixedPrecision("16-mixed", "cpu", scaler=user)])
    model = tiny()
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.ones(2, 4)).sum() * float("inf"))
    optimizer.step()
    assert fabric._precision.scaler is user and user.get_scale() == 512.0
    fabric.save(tmp_path / "ckpt", {"model": model})
    fresh_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    fresh = Fabric(accelerator="cpu", plugins=[precision_module.MixedPrecision("16-mixed", "cpu", scaler=fresh_scaler)])
    fresh.load(tmp_path / "ckpt", {"model": fresh.setup(tiny())})
    assert fresh_scaler.get_scale() == 512.0


@pytest.mark.parametrize(
    ("mode", "layer", "stored"), [("nf4", "Linear4bit", torch.uint8), ("int8", "Linear8bitLt", torch.int8)]
)
def test_bitsandbytes_precision_quantizes_the_linear_layers_outside_ignore_modules(mode, layer, stored):
    pytest.importorskip("bitsandbytes", reason="needs bitsandbytes (not in the test requirements)")
    from fabriclite.plugins import BitsandbytesPrecision

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    expected = model(torch.ones(2, 64))
    precision = BitsandbytesPrecision(mode, dtype=torch.float16 if mode == "int8" else torch.bfloat16)
    fabric = Fabric(accelerator="cpu", plugins=[precision])
    quantized = fabric.setup(model)  # bitsandbytes quantizes as the layers move to the device
    assert [type(m).__name__ for m in quantized.module if not isinstance(m, torch.nn.ReLU)] == [layer, layer]
    assert quantized.module[0].weight.dtype == stored
    out = quantized(torch.ones(2, 64))
    assert out.dtype == torch.float32 and torch.allclose(out, expected, atol=0.1) and not torch.equal(out, expected)
    kept = BitsandbytesPrecision(mode, ignore_modules={"2"}).convert_module(
        torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    )
    assert [type(m).__name__ for m in kept] == [layer, layer, "Linear"]
    with pytest.raises(ValueError, match="'int8' only works with `dtype=torch.float16`"):
        BitsandbytesPrecision("int8", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="mode='nf8'.*Valid: 'nf4'"):
        BitsandbytesPrecision("nf8")
    with pytest.raises(TypeError, match="your model has no Linear layers"):
        precision.convert_module(torch.nn.ReLU())
