"""Lightning Fabric's ``BitsandbytesPrecision``, at its import path: the ``nn.Linear`` layers of a model become
``bitsandbytes`` 4-bit (NF4, FP4, with or without double quantisation) or 8-bit layers, and the forward runs in
``dtype``.

Importable everywhere; building one needs the ``bitsandbytes`` package (Lightning's ``ModuleNotFoundError``
otherwise). The layers are bitsandbytes' own, which quantise as they move to the device, a CPU too with
bitsandbytes >= 0.49 (Lightning's subclasses refuse anything but CUDA). What differs from Lightning: the layers are
swapped in ``fabric.setup`` (``convert_module``), not while ``fabric.init_module()`` builds the model, so build the
model normally (or load its weights) before ``setup``.

Usage: ``Fabric(plugins=[BitsandbytesPrecision("nf4-dq", dtype=torch.bfloat16)])``.
"""

from __future__ import annotations

from typing import Any, ContextManager

import torch

from fabriclite._versions import _Requirement
from fabriclite.plugins.precision import Precision, _cast_floating, _cast_inputs, default_dtype

# mode -> (bitsandbytes layer, its settings)
MODES: dict[str, tuple[str, dict[str, Any]]] = {
    "nf4": ("Linear4bit", {"quant_type": "nf4", "compress_statistics": False}),
    "nf4-dq": ("Linear4bit", {"quant_type": "nf4", "compress_statistics": True}),
    "fp4": ("Linear4bit", {"quant_type": "fp4", "compress_statistics": False}),
    "fp4-dq": ("Linear4bit", {"quant_type": "fp4", "compress_statistics": True}),
    "int8-training": ("Linear8bitLt", {"has_fp16_weights": True}),
    "int8": ("Linear8bitLt", {"has_fp16_weights": False}),
}


_BITSANDBYTES_AVAILABLE = _Requirement("bitsandbytes")


def _import_bitsandbytes() -> Any:
    if not _BITSANDBYTES_AVAILABLE:
        raise ModuleNotFoundError(str(_BITSANDBYTES_AVAILABLE))
    import bitsandbytes

    return bitsandbytes


class BitsandbytesPrecision(Precision):
    """Quantise the model's linear layers with bitsandbytes: ``mode`` is one of "nf4", "nf4-dq", "fp4", "fp4-dq"
    (4-bit), "int8" (8-bit inference) or "int8-training"; ``dtype`` is the compute dtype (by default fp16 for the
    int8 modes, which accept only fp16, else bf16 where the GPU has it); ``ignore_modules`` are name prefixes of
    submodules whose linear layers stay as they are (e.g. ``{"lm_head"}``).

    Usage: ``Fabric(plugins=[BitsandbytesPrecision("nf4", ignore_modules={"lm_head"})])``.
    """

    passthrough = False

    def __init__(self, mode: str, dtype: torch.dtype | None = None, ignore_modules: set[str] | None = None) -> None:
        _import_bitsandbytes()
        if mode not in MODES:
            raise ValueError(
                f"BitsandbytesPrecision(mode={mode!r}) is not supported. Valid: {', '.join(map(repr, MODES))}."
            )
        if dtype is None:
            bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
            dtype = torch.float16 if mode.startswith("int8") or not bf16 else torch.bfloat16
        if mode.startswith("int8") and dtype is not torch.float16:
            raise ValueError(f"{mode!r} only works with `dtype=torch.float16`, but you chose `{dtype}`")
        self.name = f"bitsandbytes-{mode}"
        self.mode = mode
        self.dtype = dtype
        self.ignore_modules = set(ignore_modules or ())

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Replace each ``nn.Linear`` outside ``ignore_modules`` by its bitsandbytes layer, holding the same weights
        (quantised when the layer moves to the device)."""
        if not any(isinstance(m, torch.nn.Linear) for m in module.modules()):
            raise TypeError(
                "You are using the bitsandbytes precision plugin, but your model has no Linear layers. This plugin"
                " won't work for your model."
            )
        bnb = _import_bitsandbytes()
        if not any(isinstance(m, (bnb.nn.Linear8bitLt, bnb.nn.Linear4bit)) for m in module.modules()):
            self._replace_linears(bnb, module, "")
        for m in module.modules():
            if isinstance(m, bnb.nn.Linear4bit):
                m.compute_dtype = self.dtype
        return module

    def _replace_linears(self, bnb: Any, module: torch.nn.Module, prefix: str) -> None:
        layer_name, settings = MODES[self.mode]
        for name, child in module.named_children():
            full_name = f"{prefix}.{name}" if prefix else name
            if not isinstance(child, torch.nn.Linear) or any(full_name.startswith(p) for p in self.ignore_modules):
                self._replace_linears(bnb, child, full_name)
                continue
            weight = child.weight.data.detach().clone()
            if layer_name == "Linear4bit":
                layer = bnb.nn.Linear4bit(
                    child.in_features,
                    child.out_features,
                    bias=child.bias is not None,
                    compute_dtype=self.dtype,
                    **settings,
                )
                layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, **settings)
            else:
                trainable = settings["has_fp16_weights"]
                layer = bnb.nn.Linear8bitLt(
                    child.in_features, child.out_features, bias=child.bias is not None, **settings
                )
                layer.weight = bnb.nn.Int8Params(weight, requires_grad=trainable, has_fp16_weights=trainable)
            if child.bias is not None:
                layer.bias = torch.nn.Parameter(
                    child.bias.data.detach().clone(), requires_grad=child.bias.requires_grad
                )
            setattr(module, name, layer)

    def module_init_context(self) -> ContextManager:
        if self.ignore_modules:
            raise RuntimeError(
                "Instantiating your model under the `init_module` context manager is not supported when used with"
                f" `BitsandbytesPrecision(..., ignore_modules={self.ignore_modules})` as this"
                " may initialize the layers on-device, defeating the purpose of quantization. You can remove"
                " `ignore_modules` or remove the `init_module` context manager."
            )
        return default_dtype(self.dtype)

    def forward_context(self) -> ContextManager:
        return default_dtype(self.dtype)

    def convert_input(self, data: Any) -> Any:
        return _cast_inputs(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        return _cast_floating(data, torch.get_default_dtype())

    def __repr__(self) -> str:
        return f"BitsandbytesPrecision(mode={self.mode!r}, dtype={self.dtype})"
