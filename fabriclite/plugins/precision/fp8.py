"""fp8 training, ``precision="fp8-mixed"``: the model's eligible ``nn.Linear`` layers become torchao's float8
training layers (``torchao.float8.convert_to_float8_training``), whose three matrix products (output, input
gradient, weight gradient) run in float8 with dynamic scales; everything else runs as in ``"bf16-mixed"``.

The parameters and the optimizer state stay in fp32 (the layers cast to float8 on the fly), so a checkpoint has
the keys and dtypes of the unconverted model: it loads into a ``"bf16-mixed"`` run and back. torchao is an optional
dependency, checked against this torch in ``fabriclite._versions``.

Where it runs: a CUDA GPU of compute capability 8.9 or more (Ada, Hopper, Blackwell), best under ``compile=True``
(eager float8 casts cost more than they save); or anywhere under torchao's emulation (``emulate=True``, the
default on a CPU): the numerics of fp8, not its speed, for tests and CI.

Usage: ``Fabric(precision="fp8-mixed", compile=True)`` or ``Fabric(plugins=[Float8Precision("rowwise")])``.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch

from fabriclite._versions import torchao_float8
from fabriclite.choices import did_you_mean
from fabriclite.plugins.precision import MixedPrecision
from fabriclite.rank_zero import rank_zero_info, rank_zero_warn

# torchao's recipes (Float8LinearRecipeName): per-tensor scales, per-row scales, and per-row with the weight
# gradient kept in high precision.
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")
# float8 matrix products (torch._scaled_mm) need compute capability 8.9: Ada (L4, L40), Hopper (H100, H200), newer.
MIN_CAPABILITY = (8, 9)
# The hardware float8 kernels need both dimensions of a weight divisible by 16.
DIVISOR = 16


class Float8Precision(MixedPrecision):
    """fp8 training through torchao: eligible ``nn.Linear`` layers (both dimensions divisible by 16) compute in
    float8, the rest of the forward in bf16 autocast, parameters and optimizer state in fp32.

    - ``recipe``: "tensorwise" (one scale per tensor, the fastest), "rowwise" (one per row, more accurate) or
      "rowwise_with_gw_hp" (rowwise, weight gradient in high precision).
    - ``ignore_modules``: names of submodules left in bf16 with every layer inside them (``{"blocks.0.attn"}``).
    - ``keep_head``: leave the model's last ``nn.Linear`` (its output head in the usual layout: GPT's ``lm_head``,
      a ViT's ``head``) in bf16, as torchtitan does with its output layer; fp8 costs accuracy most there.
    - ``emulate``: torchao's emulation, float8 rounding with the products in high precision (None: on a CPU
      only). False is refused anywhere but on a CUDA GPU of compute capability >= 8.9.
    - ``float8_all_gather``: under FSDP2, all-gather the weights in float8 (half bf16's traffic; tensorwise only).
      None: on whenever the model is sharded and the recipe is tensorwise.

    Usage: ``Fabric(plugins=[Float8Precision("rowwise", ignore_modules={"blocks.0"})], compile=True)``.
    """

    DTYPES = {"fp8-mixed": torch.bfloat16}  # what runs outside the float8 layers

    def __init__(
        self,
        recipe: str = "tensorwise",
        *,
        ignore_modules: set[str] | None = None,
        keep_head: bool = True,
        emulate: bool | None = None,
        float8_all_gather: bool | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self._float8 = torchao_float8()  # refuses here, at Fabric(...), without a matching torchao
        if recipe not in RECIPES:
            raise ValueError(
                f"Float8Precision(recipe={recipe!r}) is not supported. Valid: "
                f"{', '.join(map(repr, RECIPES))}.{did_you_mean(recipe, RECIPES)}"
            )
        if float8_all_gather and recipe != "tensorwise":
            raise ValueError(
                f"Float8Precision(float8_all_gather=True) needs recipe='tensorwise' (torchao all-gathers float8 "
                f"weights with one scale per tensor), not {recipe!r}. Leave float8_all_gather out for {recipe!r}."
            )
        self.recipe = recipe
        self.ignore_modules = set(ignore_modules or ())
        self.keep_head = keep_head
        self.emulate = emulate
        self.float8_all_gather = float8_all_gather
        self.converted: list[str] = []  # the layers convert_module turned into float8 layers, by name
        self._sharded = False
        # The sharded models whose float8 weight scales are computed after their optimizer's step, in the order they
        # were set up; a model dropped goes with it.
        self._scale_modules: list[weakref.ref[torch.nn.Module]] = []
        self._optimizer_modules: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._replaced: dict[str, torch.nn.Parameter] = {}
        super().__init__("fp8-mixed", device)

    def place(self, device: torch.device) -> None:
        """Run on ``device``: decide emulation there, or refuse a device without float8 matrix products."""
        if self.device_type is not None:
            return
        super().place(device)
        if device.type == "cuda":
            capability = torch.cuda.get_device_capability(device)
            if self.emulate is None:
                self.emulate = False
            if not self.emulate and capability < MIN_CAPABILITY:
                raise ValueError(
                    f"precision='fp8-mixed' needs a GPU with float8 matrix products (compute capability >= 8.9: L4, "
                    f"L40, H100, H200 or newer); {torch.cuda.get_device_name(device)} has compute capability "
                    f"{capability[0]}.{capability[1]}. Use precision='bf16-mixed', or "
                    "Float8Precision(emulate=True) to check fp8's numerics (not its speed)."
                )
            return
        if self.emulate is None and device.type == "cpu":
            self.emulate = True
        if not self.emulate:
            raise ValueError(
                f"Float8Precision(emulate={self.emulate}) on {device.type}: float8 matrix products run on CUDA GPUs "
                "of compute capability >= 8.9 only. Pass emulate=True to emulate them (fp8's numerics, not its "
                "speed), or run on such a GPU."
            )

    def agree_across_ranks(self) -> None:
        """Sharding strategies call this once the processes run: the model will be sharded, so float8 all-gathers
        pay (see ``float8_all_gather``). Usage: ``precision.agree_across_ranks()``."""
        super().agree_across_ranks()
        self._sharded = True

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        """Turn each eligible ``nn.Linear`` of ``module`` into torchao's float8 layer, in place; a model that has
        float8 layers already (converted by the user) is left as it is."""
        float8_linear = self._float8.float8_linear.Float8Linear
        self._replaced = {}  # this module's only
        if any(isinstance(m, float8_linear) for m in module.modules()):
            self.converted = [name for name, m in module.named_modules() if isinstance(m, float8_linear)]
            return module
        names = dict(module.named_modules())
        missing = sorted(name for name in self.ignore_modules if name not in names)
        if missing:
            raise ValueError(
                f"Float8Precision(ignore_modules=...) names {missing}, which {type(module).__name__} does not have."
                f"{did_you_mean(missing[0], list(names))} Its submodules with Linear layers: "
                f"{sorted({n.rsplit('.', 1)[0] for n, m in names.items() if isinstance(m, torch.nn.Linear)})[:10]}."
            )
        if self.float8_all_gather and not self._sharded:
            raise ValueError(
                "Float8Precision(float8_all_gather=True) is for a sharded model: use strategy='fsdp' (or a "
                "ModelParallelStrategy), or leave float8_all_gather out."
            )
        linears = [name for name, m in names.items() if isinstance(m, torch.nn.Linear)]
        kept = set(self.ignore_modules) | ({linears[-1]} if self.keep_head and linears else set())
        self.converted = [name for name in linears if self._eligible(names[name], name, kept)]
        chosen = set(self.converted)
        weights = {f"{name}.weight": names[name].weight for name in self.converted}
        self._float8.convert_to_float8_training(
            module, module_filter_fn=lambda _, name: name in chosen, config=self._config()
        )
        # float8 all-gathers wrap each weight in a new parameter; the user's optimizer holds the old one.
        self._replaced = {name: old for name, old in weights.items() if module.get_parameter(name) is not old}
        if not self.converted:
            rank_zero_warn(
                f"precision='fp8-mixed' found no Linear layer to run in float8 in {type(module).__name__}: of its "
                f"{len(linears)} Linear layers, each is kept (the head, ignore_modules) or has a dimension not "
                f"divisible by {DIVISOR}. The model trains as with 'bf16-mixed'.",
                stacklevel=7,  # the fabric.setup line
            )
        else:
            rank_zero_info(f"fp8-mixed: {len(self.converted)} of {len(linears)} Linear layers run in float8")
        if self._all_gather() and self._sharded:
            self._scale_modules.append(weakref.ref(module))
        return module

    def replaced_parameters(self) -> dict[str, torch.nn.Parameter]:
        return self._replaced

    def _eligible(self, layer: torch.nn.Linear, name: str, kept: set[str]) -> bool:
        if name == "" or any(name == k or name.startswith(k + ".") for k in kept):
            return False  # a bare Linear as the model is its own head; torchao would replace it, not convert it
        if isinstance(layer.weight, torch.nn.parameter.UninitializedParameter):
            return False  # a LazyLinear before its first forward: its sizes are not known yet
        return layer.in_features % DIVISOR == 0 and layer.out_features % DIVISOR == 0

    def _all_gather(self) -> bool:
        if self.float8_all_gather is None:
            return self._sharded and self.recipe == "tensorwise"
        return self.float8_all_gather

    def _config(self) -> Any:
        config = self._float8.Float8LinearConfig.from_recipe_name(self.recipe)
        return dataclasses.replace(config, emulate=bool(self.emulate), enable_fsdp_float8_all_gather=self._all_gather())

    def optimizer_step(self, optimizer: torch.optim.Optimizer, **kwargs: Any) -> Any:
        result = optimizer.step(**kwargs)
        # With float8 all-gathers, the next forward needs each weight's scale: one all-reduce for all of them
        # here instead of one per layer inside the forward (torchao's advice).
        if self._scale_modules:
            for module in self._stepped_modules(optimizer):
                self._float8.precompute_float8_dynamic_scale_for_fsdp(module)
        return result

    def _stepped_modules(self, optimizer: torch.optim.Optimizer) -> list[torch.nn.Module]:
        # The sharded float8 models whose parameters this optimizer steps, in the order they were set up (the same
        # on every rank: each scale computation is an all-reduce). Found at the optimizer's first step.
        refs = self._optimizer_modules.get(optimizer)
        if refs is None:
            params = {id(p) for group in optimizer.param_groups for p in group["params"]}
            live = [module for module in (ref() for ref in self._scale_modules) if module is not None]
            refs = [weakref.ref(m) for m in live if any(id(p) in params for p in m.parameters())]
            self._optimizer_modules[optimizer] = refs
        return [module for module in (ref() for ref in refs) if module is not None]

    def note_not_compiled(self) -> None:
        if self.device_type == "cuda" and not self.emulate:
            rank_zero_warn(
                "precision='fp8-mixed' without compile=True: eager float8 layers spend more time casting than the "
                "float8 products save, so this step is likely slower than 'bf16-mixed'. Pass Fabric(compile=True).",
                stacklevel=7,  # the fabric.setup line
            )

    def __repr__(self) -> str:
        return f"Float8Precision(recipe={self.recipe!r}, emulate={self.emulate})"
