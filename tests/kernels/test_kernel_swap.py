import copy

import pytest
import torch
from kernel_checks import DEVICE, assert_matches, launched
from torch import nn

from fabriclite.kernels import LayerNorm, RMSNorm, kernels_available, swap, swap_modules
from fabriclite.kernels.swap import ops_to_swap

pytestmark = pytest.mark.torch_versions  # also run on the other torch versions CI tests


class _CustomNorm(nn.LayerNorm):
    """A user's subclass: its forward may differ, so it must be left alone."""


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm_in = nn.LayerNorm(13)
        self.linear = nn.Linear(13, 13)
        self.norm_mid = nn.RMSNorm(13, eps=1e-6)
        self.shared = nn.LayerNorm(13, bias=False)
        self.layers = nn.ModuleList([self.shared, self.shared, _CustomNorm(13)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm_mid(self.linear(self.norm_in(x)))
        for layer in self.layers:
            x = layer(x)
        return x


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = _Block().to(DEVICE)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    return model


def test_swap_replaces_norms_in_place_keeping_the_parameter_objects_and_state_dict():
    model = _model()
    parameters = dict(model.named_parameters())
    state = {key: value.clone() for key, value in model.state_dict().items()}
    x = torch.randn(3, 13, device=DEVICE)
    expected = model(x)

    with launched("_norm_forward_kernel"):
        assert swap_modules(model) == 3  # norm_in, norm_mid and the shared norm, counted once
        out = model(x)

    assert type(model.norm_in) is LayerNorm and type(model.shared) is LayerNorm
    assert type(model.norm_mid) is RMSNorm
    assert model.layers[0] is model.layers[1] is model.shared, "a shared norm must stay shared"
    assert type(model.layers[2]) is _CustomNorm
    assert model.shared.bias is None and model.norm_mid.eps == 1e-6
    after = dict(model.named_parameters())
    assert list(after) == list(parameters) and all(after[name] is parameters[name] for name in parameters)
    assert list(model.state_dict()) == list(state)
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key])
    torch.testing.assert_close(out, expected)


def test_swap_leaves_norms_with_hooks_the_root_and_the_training_flag_alone():
    model = _model().eval()
    model.norm_in.register_forward_hook(lambda module, args, output: None)
    assert swap_modules(model) == 2
    assert type(model.norm_in) is nn.LayerNorm
    assert not model.norm_mid.training and not model.shared.training

    root = nn.LayerNorm(5)
    assert swap_modules(root) == 0 and type(root) is nn.LayerNorm


def test_the_swapped_model_trains_through_the_kernels():
    model = _model()
    reference = _model()
    swap_modules(model)
    x = torch.randn(4, 13, device=DEVICE)
    with launched("_norm_backward_kernel"):
        model(x).square().mean().backward()
    reference(x).square().mean().backward()
    for (name, parameter), expected in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(parameter.grad, expected.grad, rtol=1e-4, atol=1e-5, msg=name)


def test_a_swapped_rms_norm_without_eps_on_bf16_matches_torch_which_uses_fp32_eps():
    torch.manual_seed(1)
    model = nn.Sequential(nn.RMSNorm(64, eps=None)).to(DEVICE, torch.bfloat16)
    nn.init.normal_(model[0].weight, 1.0, 0.1)
    reference = copy.deepcopy(model).float()  # torch computes a bf16 RMS norm in fp32, with fp32's eps
    x = (0.05 * torch.randn(8, 64, device=DEVICE)).bfloat16()  # mean(x ** 2) = 0.0025, below bf16's eps 0.0078

    assert swap_modules(model) == 1 and model[0].eps is None
    with launched("_norm_forward_kernel"):
        out = model(x)
    assert_matches(out, reference(x.float()).double(), torch.bfloat16)


def test_kernels_are_available_on_cpu_only_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert kernels_available("cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels_available(torch.device("cpu"))
    assert not kernels_available("meta")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the answer on a machine without CUDA")
def test_kernels_are_not_available_on_cuda_without_a_gpu():
    assert not kernels_available("cuda")


def test_swap_modules_replaces_only_the_kinds_named_and_refuses_unknown_ones():
    model = _model()
    assert swap_modules(model, ["rms_norm"]) == 1
    assert type(model.norm_mid) is RMSNorm and type(model.norm_in) is nn.LayerNorm
    with pytest.raises(ValueError, match=r"\['groupnorm'\].*'layer_norm', 'rms_norm'"):
        swap_modules(model, ["groupnorm"])


def test_the_rule_swaps_nothing_under_compile_and_on_cuda_only_measured_wins_at_their_widths(monkeypatch):
    assert ops_to_swap("cpu", compiled=False) == {"layer_norm": None, "rms_norm": None}  # the interpreter: for tests
    assert ops_to_swap("cpu", compiled=True) == {}
    name = "NVIDIA A100-SXM4-80GB"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    assert ops_to_swap("cuda:0", compiled=False) == {}  # no measured win on this class of GPU
    name = "NVIDIA H100 80GB HBM3"
    monkeypatch.setattr(swap, "MEASURED_WINS", {("H100/H200", "rms_norm"): frozenset({4096})})
    assert ops_to_swap("cuda:0", compiled=False) == {"rms_norm": frozenset({4096})}
    assert ops_to_swap("cuda:0", compiled=True) == {}


class _Unhashable(int):
    """A width that cannot be hashed, as a symbolic one (``torch.SymInt``) under compile cannot."""

    __hash__ = None


def test_the_norm_backward_takes_the_row_loop_only_where_it_measured_faster_on_that_class_of_gpu(monkeypatch):
    name = "NVIDIA H200"  # the GPU's name is faked (no GPU here): the rule reads nothing else of it
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    cuda = torch.device("cuda", 0)
    swap._row_loop_widths.cache_clear()
    try:
        assert swap.ROW_LOOP_WINS == {("H100/H200", "rms_norm"): frozenset({4096})}  # the H200 run of 2026-11-27
        assert swap.row_loop_measured_faster(cuda, "rms_norm", 4096)
        assert swap.row_loop_measured_faster(cuda, "rms_norm", _Unhashable(4096))  # compared, never hashed
        assert not swap.row_loop_measured_faster(cuda, "rms_norm", 2048)
        assert not swap.row_loop_measured_faster(cuda, "layer_norm", 4096)
        assert not swap.row_loop_measured_faster(torch.device("cpu"), "rms_norm", 4096)  # the interpreter: tiles
        swap._row_loop_widths.cache_clear()
        name = "NVIDIA A100-SXM4-80GB"  # no measurement for this class: the tiles
        assert not swap.row_loop_measured_faster(cuda, "rms_norm", 4096)
    finally:
        swap._row_loop_widths.cache_clear()


def test_gpus_are_known_by_their_class():
    assert swap.device_class("NVIDIA H200") == "H100/H200"
    assert swap.device_class("NVIDIA H100 80GB HBM3") == "H100/H200"
    assert swap.device_class("NVIDIA A100-SXM4-80GB") is None
    assert swap.device_class("NVIDIA GH100") is None  # a word of the name, not any substring


def test_swap_modules_swaps_a_measured_op_only_at_its_measured_widths():
    model = nn.Sequential(nn.LayerNorm(768), nn.LayerNorm(1024), nn.RMSNorm(768), nn.LayerNorm((3, 256)))
    assert swap_modules(model, {"layer_norm": frozenset({768})}) == 2  # (3, 256) normalizes 768 elements a row
    assert [type(m) for m in model] == [LayerNorm, nn.LayerNorm, nn.RMSNorm, LayerNorm]
    model = nn.Sequential(nn.LayerNorm(768), nn.RMSNorm(1024))
    assert swap_modules(model, {"rms_norm": None}) == 1 and type(model[1]) is RMSNorm


def test_fabric_with_kernels_swaps_by_the_rule_and_says_when_it_swaps_nothing(monkeypatch):
    from fabriclite import Fabric

    fabric = Fabric(accelerator=DEVICE.type, devices=1, kernels=True)
    if DEVICE.type == "cpu":
        assert ops_to_swap(DEVICE, compiled=False) == {"layer_norm": None, "rms_norm": None}
    monkeypatch.setattr(swap, "ops_to_swap", lambda device, compiled: {"layer_norm": None})
    model = fabric.setup(_model())
    assert type(model.module.norm_in) is LayerNorm and type(model.module.norm_mid) is nn.RMSNorm

    monkeypatch.setattr(swap, "ops_to_swap", lambda device, compiled: ())
    with pytest.warns(UserWarning, match=r"kernels=True\) leaves the model's norms to torch on"):
        model = fabric.setup(_model())
    assert type(model.module.norm_in) is nn.LayerNorm

    # A measured win at other widths than the model's: nothing swapped, and the same warning says so.
    monkeypatch.setattr(swap, "ops_to_swap", lambda device, compiled: {"layer_norm": frozenset({7})})
    with pytest.warns(UserWarning, match=r"no kernel has a measured win for this model's norms"):
        model = fabric.setup(_model())
    assert type(model.module.norm_in) is nn.LayerNorm
