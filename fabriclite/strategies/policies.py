"""Wrap policies: which modules of a model become FSDP units (``auto_wrap_policy``) or recompute their activations
in backward (``activation_checkpointing_policy``), in every form Lightning and torch document, each with the
meaning FSDP1 gives it (Lightning Fabric hands these policies to FSDP1; fabriclite's FSDP2 units are then the
modules FSDP1 would have wrapped):

- layer classes (one class, or a set, list or tuple of them): every module of those classes, FSDP1's
  ``ModuleWrapPolicy``;
- a function ``module -> bool``: every module it says yes to (fabriclite's own form, as ``lambda_auto_wrap_policy``);
- an FSDP1 policy function, which FSDP1 calls as ``policy(module=..., recurse=..., nonwrapped_numel=...)``: torch's
  ``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy``, ``lambda_auto_wrap_policy``,
  ``always_wrap_policy``, their ``functools.partial``s, or the user's own with those parameters. The model is walked
  as FSDP1's ``_recursive_wrap`` walks it: from the root down while ``recurse=True`` says to go on, deciding on the
  way back up, where ``nonwrapped_numel`` is the number of parameters the module holds minus those its picked
  descendants took (so a size-based policy picks a module once what is left of it is large enough);
- an FSDP1 policy object, ``ModuleWrapPolicy`` or ``CustomPolicy``: the modules it picks, as FSDP1 runs it, with
  the keyword arguments a ``CustomPolicy`` function may return for a module (``fsdp.py`` says which it maps).

The root is never picked (the strategy makes it the last unit itself, as FSDP1 does). A container without a
``forward`` of its own (``nn.ModuleList``, ``nn.ModuleDict``) is never picked either: FSDP2 gathers a unit's
parameters when the unit's forward runs, and a container's never runs, so its parameters belong to the unit above.

Usage: ``picked = WrapPolicy(partial(size_based_auto_wrap_policy, min_num_params=10**6), "auto_wrap_policy").select(model)``.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Union

from torch import nn

from fabriclite._versions import fsdp1_policy_targets

# A set of layer classes, a function module -> bool, an FSDP1 policy function or object (see the module docstring).
ModulePolicy = Union[set, frozenset, list, tuple, type, Callable[..., bool], Any, None]

_FORMS = (
    "layer classes ({Block}), a function module -> bool, an FSDP1 policy function called as "
    "policy(module=..., recurse=..., nonwrapped_numel=...) (functools.partial(transformer_auto_wrap_policy, "
    "transformer_layer_cls={Block}), functools.partial(size_based_auto_wrap_policy, min_num_params=...), ...), or "
    "a ModuleWrapPolicy or CustomPolicy from torch.distributed.fsdp.wrap"
)


class WrapPolicy:
    """One policy in any of the forms above (``what`` names the argument it came in, for errors), checked when it
    is given; ``select(model)`` returns the modules it picks.

    Usage: ``WrapPolicy({Block}, "auto_wrap_policy").select(model)`` -> ``{block: {}, ...}``.
    """

    def __init__(self, policy: ModulePolicy, what: str) -> None:
        from torch.distributed.fsdp.wrap import CustomPolicy, ModuleWrapPolicy

        self.policy = policy
        self.what = what
        # The FSDP1 policy function to walk the model with; None for a policy object, which picks by itself.
        self._walk: Callable[..., bool] | None = None
        if isinstance(policy, (ModuleWrapPolicy, CustomPolicy)):
            return
        if isinstance(policy, type):
            policy = {policy}
        if isinstance(policy, (set, frozenset, list, tuple)):
            classes = tuple(policy)
            if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
                raise TypeError(f"{what}={policy!r} must hold nn.Module subclasses, e.g. {{TransformerBlock}}.")
            self._walk = functools.partial(_instance_of, classes)  # picklable, for ddp_spawn's new processes
        elif not callable(policy):
            raise TypeError(f"{what}={policy!r} is none of the forms a policy takes: {_FORMS}.")
        elif _accepts(policy, module=None, recurse=True, nonwrapped_numel=0):
            self._walk = policy
        elif _accepts(policy, None):
            self._walk = functools.partial(_says_yes, policy)
        else:
            raise TypeError(
                f"{what}={policy!r} cannot be called as FSDP1 calls a policy, policy(module=..., recurse=..., "
                f"nonwrapped_numel=...) ({_why_not(policy)}), nor as a function module -> bool. A policy is one of: "
                f"{_FORMS}."
            )

    def select(self, root: nn.Module) -> dict[nn.Module, dict[str, Any]]:
        """The modules of ``root`` this policy picks, innermost first (each after every module inside it), each
        with the keyword arguments a ``CustomPolicy`` gave it (``{}`` otherwise); never ``root`` itself."""
        if self._walk is None:
            picked = fsdp1_policy_targets(self.policy, root)
        else:
            picked = dict.fromkeys(_fsdp1_walk(root, self._walk, self.what), {})
        return {
            module: dict(picked[module])
            for module in _post_order(root)
            if module in picked and module is not root and type(module).forward is not nn.Module.forward
        }

    def __repr__(self) -> str:
        return f"WrapPolicy({self.policy!r})"


def module_policy(policy: ModulePolicy, what: str) -> WrapPolicy | None:
    """``policy`` as a ``WrapPolicy`` (None stays None: the strategy's default). Usage: ``module_policy({Block}, "x")``."""
    return None if policy is None else WrapPolicy(policy, what)


def _fsdp1_walk(root: nn.Module, policy: Callable[..., bool], what: str) -> list[nn.Module]:
    """The modules FSDP1's ``_recursive_wrap`` wraps for ``policy``, children before their parents: the same
    questions asked in the same order, with the same counts of parameters not yet wrapped."""
    picked: list[nn.Module] = []

    def ask(module: nn.Module, recurse: bool, numel: int) -> bool:
        try:
            return bool(policy(module=module, recurse=recurse, nonwrapped_numel=numel))
        except TypeError as error:  # e.g. a partial missing a required argument of the policy it binds
            raise TypeError(f"{what}={policy!r} failed when called as FSDP1 calls it: {error}") from error

    def walk(module: nn.Module, is_root: bool) -> int:
        # Returns how many parameters are wrapped at or under ``module``.
        numel = sum(p.numel() for p in module.parameters())
        if not ask(module, True, numel):
            return 0
        wrapped = sum(walk(child, False) for child in module.children())
        if not is_root and ask(module, False, numel - wrapped):
            picked.append(module)
            return numel
        return wrapped

    walk(root, True)
    return picked


def _post_order(root: nn.Module) -> list[nn.Module]:
    # Each module once (a shared one at its first place), after all the modules inside it.
    order: list[nn.Module] = []
    seen = {id(root)}

    def visit(module: nn.Module) -> None:
        for child in module.children():
            if id(child) not in seen:
                seen.add(id(child))
                visit(child)
        order.append(module)

    visit(root)
    return order


def _instance_of(classes: tuple[type, ...], module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or isinstance(module, classes)


def _says_yes(function: Callable[[nn.Module], Any], module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
    return recurse or bool(function(module))


def _accepts(function: Callable[..., Any], *args: Any, **kwargs: Any) -> bool:
    try:
        inspect.signature(function).bind(*args, **kwargs)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): taken as a function module -> bool
        return not kwargs
    return True


def _why_not(function: Callable[..., Any]) -> str:
    try:
        inspect.signature(function).bind(module=None, recurse=True, nonwrapped_numel=0)
    except TypeError as error:
        return str(error)
    return "no signature"
