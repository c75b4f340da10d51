"""Lightning Fabric's ``TransformerEnginePrecision``, at its import path, and its precision strings
``"transformer-engine"`` (bf16 weights) and ``"transformer-engine-float16"`` (fp16 weights): fp8 through NVIDIA's
Transformer Engine, whose ``Linear`` and ``LayerNorm`` replace torch's and whose ``fp8_autocast`` runs the forward.

Importable everywhere; building one needs the ``transformer_engine`` package (on a CUDA machine), and without it
raises Lightning's ``ModuleNotFoundError`` saying what to install, never falling back to bf16. fabriclite's own fp8,
``precision="fp8-mixed"`` (``Float8Precision``), needs only torchao. Not run here: Transformer Engine does not
install without CUDA, so the tests check the refusal and the layer swap against a stand-in module.

Usage: ``Fabric(precision="transformer-engine")`` or
``Fabric(plugins=[TransformerEnginePrecision(weights_dtype=torch.bfloat16)])``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import ExitStack
from typing import Any, ContextManager

import torch

from fabriclite._versions import _Requirement
from fabriclite.plugins.precision import Precision, _cast_floating, _cast_inputs, default_dtype
from fabriclite.rank_zero import rank_zero_warn

_TRANSFORMER_ENGINE_AVAILABLE = _Requirement("transformer_engine", "transformer-engine[pytorch]")


def _import_transformer_engine() -> Any:
    if not _TRANSFORMER_ENGINE_AVAILABLE:
        raise ModuleNotFoundError(
            f"{_TRANSFORMER_ENGINE_AVAILABLE} (TransformerEnginePrecision, precision='transformer-engine', needs "
            "NVIDIA Transformer Engine on a CUDA machine). fabriclite's own fp8 needs only torchao: "
            "precision='fp8-mixed' (pip install 'fabriclite[fp8]')."
        )
    import transformer_engine.pytorch as te

    return te


class TransformerEnginePrecision(Precision):
    """fp8 through NVIDIA's Transformer Engine: the weights in ``weights_dtype``, Linear and LayerNorm layers
    replaced by Transformer Engine's (``replace_layers``, None: yes unless the model has its layers already), the
    forward under ``fp8_autocast(recipe)`` inside an autocast to ``fallback_compute_dtype`` for the other ops.

    Usage: ``Fabric(plugins=[TransformerEnginePrecision(weights_dtype=torch.bfloat16)])``.
    """

    passthrough = False

    def __init__(
        self,
        *,
        weights_dtype: torch.dtype,
        recipe: Mapping[str, Any] | Any = None,
        replace_layers: bool | None = None,
        fallback_compute_dtype: torch.dtype | None = None,
    ) -> None:
        self._te = _import_transformer_engine()
        from transformer_engine.common import recipe as te_recipe

        if recipe is None:
            recipe = te_recipe.DelayedScaling()
        elif isinstance(recipe, Mapping):
            settings = dict(recipe)
            if isinstance(settings.get("fp8_format"), str):  # Lightning takes the format's name too
                settings["fp8_format"] = getattr(te_recipe.Format, settings["fp8_format"])
            recipe = te_recipe.DelayedScaling(**settings)
        self.name = "transformer-engine-float16" if weights_dtype == torch.float16 else "transformer-engine"
        self.weights_dtype = weights_dtype
        self.recipe = recipe
        self.replace_layers = replace_layers
        self.fallback_compute_dtype = fallback_compute_dtype or weights_dtype

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Swap in Transformer Engine's layers (unless the model has some already), then cast to
        ``weights_dtype``."""
        has_te_layers = any(type(m).__module__.startswith("transformer_engine") for m in module.modules())
        if not has_te_layers and self.replace_layers in (None, True):
            self._replace_layers(module, "")
        return module.to(dtype=self.weights_dtype)

    def _replace_layers(self, module: torch.nn.Module, prefix: str) -> None:
        te = self._te
        for name, child in module.named_children():
            full_name = f"{prefix}.{name}" if prefix else name
            if isinstance(child, torch.nn.Linear):
                if child.in_features % 8 or child.out_features % 16:
                    rank_zero_warn(
                        f"TransformerEnginePrecision leaves {full_name!r} ({child.in_features} -> "
                        f"{child.out_features}) as it is: Transformer Engine's fp8 needs in_features divisible by 8 "
                        "and out_features by 16. Pad the layer to use fp8 there."
                    )
                    continue
                layer = te.Linear(child.in_features, child.out_features, bias=child.bias is not None)
            elif isinstance(child, torch.nn.LayerNorm):
                layer = te.LayerNorm(child.normalized_shape[0], eps=child.eps)
            else:
                self._replace_layers(child, full_name)
                continue
            with torch.no_grad():  # the same weights in the new layer
                layer.weight.copy_(child.weight)
                if getattr(child, "bias", None) is not None and getattr(layer, "bias", None) is not None:
                    layer.bias.copy_(child.bias)
            setattr(module, name, layer)

    def module_init_context(self) -> ContextManager:
        return default_dtype(self.weights_dtype)

    def forward_context(self) -> ContextManager:
        stack = ExitStack()
        stack.enter_context(default_dtype(self.weights_dtype))
        # The ops Transformer Engine has no fp8 for run in the fallback dtype.
        stack.enter_context(torch.autocast("cuda", dtype=self.fallback_compute_dtype))
        stack.enter_context(self._te.fp8_autocast(enabled=True, fp8_recipe=self.recipe))
        return stack

    def convert_input(self, data: Any) -> Any:
        return _cast_inputs(data, self.weights_dtype)

    def convert_output(self, data: Any) -> Any:
        return _cast_floating(data, torch.get_default_dtype())

    def __repr__(self) -> str:
        return f"TransformerEnginePrecision(weights_dtype={self.weights_dtype})"
