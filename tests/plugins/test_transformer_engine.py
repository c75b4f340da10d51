"""Lightning's fp8 names, ``precision="transformer-engine"``, ``"transformer-engine-float16"`` and
``TransformerEnginePrecision``: refused with what to install where Transformer Engine is absent (it installs only
with CUDA), and the layer swap checked against a stand-in module."""

from __future__ import annotations

import importlib.util
import sys
import types
from contextlib import nullcontext

import pytest
import torch
from torch import nn

from fabriclite import Fabric
from fabriclite.choices import parse_precision
from fabriclite.plugins import TransformerEnginePrecision


def test_lightnings_transformer_engine_strings_are_valid_precisions():
    assert parse_precision("transformer-engine") == "transformer-engine"
    assert parse_precision("Transformer-Engine-Float16") == "transformer-engine-float16"


@pytest.mark.parametrize("name", ["transformer-engine", "transformer-engine-float16"])
def test_lightnings_transformer_engine_string_without_it_says_what_to_install_and_never_falls_back(name):
    if importlib.util.find_spec("transformer_engine") is not None:
        pytest.skip("checks the refusal where Transformer Engine is absent")
    with pytest.raises(ModuleNotFoundError) as error:
        Fabric(accelerator="cpu", precision=name)
    message = str(error.value)
    assert "Requirement 'transformer_engine' not met" in message
    assert "pip install -U 'transformer-engine[pytorch]'" in message and "precision='fp8-mixed'" in message
    with pytest.raises(ModuleNotFoundError, match="transformer_engine"):
        TransformerEnginePrecision(weights_dtype=torch.bfloat16)


@pytest.fixture
def stand_in_transformer_engine(monkeypatch):
    """A stand-in ``transformer_engine`` (it installs only with CUDA): layers that subclass torch's, an fp8_autocast
    that records its recipe. Checks fabriclite's wiring, not Transformer Engine."""
    te = types.ModuleType("transformer_engine")
    te.__path__ = []
    pytorch = types.ModuleType("transformer_engine.pytorch")
    common = types.ModuleType("transformer_engine.common")
    recipe = types.ModuleType("transformer_engine.common.recipe")
    entered = []

    class Linear(nn.Linear):
        pass

    class LayerNorm(nn.LayerNorm):
        pass

    Linear.__module__ = LayerNorm.__module__ = "transformer_engine.pytorch.module"

    class DelayedScaling:
        def __init__(self, **settings):
            self.settings = settings

    pytorch.Linear, pytorch.LayerNorm = Linear, LayerNorm
    pytorch.fp8_autocast = lambda enabled, fp8_recipe: entered.append(fp8_recipe) or nullcontext()
    recipe.DelayedScaling, recipe.Format = DelayedScaling, types.SimpleNamespace(HYBRID="hybrid")
    te.pytorch, te.common, common.recipe = pytorch, common, recipe
    for module in (te, pytorch, common, recipe):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr("fabriclite.plugins.precision.transformer_engine._TRANSFORMER_ENGINE_AVAILABLE", True)
    return types.SimpleNamespace(Linear=Linear, LayerNorm=LayerNorm, entered=entered)


def test_transformer_engine_precision_swaps_layers_with_the_same_weights_and_casts_them(stand_in_transformer_engine):
    te = stand_in_transformer_engine
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 5))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    precision = TransformerEnginePrecision(weights_dtype=torch.bfloat16, recipe={"fp8_format": "HYBRID"})
    with pytest.warns(UserWarning, match=r"leaves '2' \(32 -> 5\) as it is"):
        precision.convert_module(model)
    assert [type(m) for m in model] == [te.Linear, te.LayerNorm, nn.Linear]
    assert all(torch.equal(model.state_dict()[k], v.to(torch.bfloat16)) for k, v in before.items())
    assert precision.recipe.settings == {"fp8_format": "hybrid"} and precision.name == "transformer-engine"
    with precision.forward_context():
        assert torch.get_default_dtype() == torch.bfloat16
    assert te.entered == [precision.recipe]
