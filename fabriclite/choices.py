"""Every user setting becomes a plain value here, in one place: accelerator, devices, precision, and the settings
``fabriclite run`` hands to the script's ``Fabric()`` through environment variables. The strategy names live beside
their classes, in ``fabriclite.strategies`` (``parse_strategy``, ``select_strategy``).

Each parser takes what a user (or a Lightning Fabric script) may pass and returns a canonical value or raises a
``ValueError`` naming the value, the valid choices and the closest match. This module imports nothing of
fabriclite: every other layer may use it.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Sequence
from typing import Any, Callable

ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps")

# "fp8-mixed": fp8 layers in a bf16-mixed run (torchao); "transformer-engine(-float16)": Lightning's fp8 strings.
PRECISIONS = ("32-true", "64-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true", "fp8-mixed")
PRECISIONS += ("transformer-engine", "transformer-engine-float16")
# "fp8" is Accelerate's mixed_precision name.
_PRECISION_ALIASES = {"32": "32-true", "64": "64-true", "16": "16-mixed", "bf16": "bf16-mixed", "fp8": "fp8-mixed"}


def did_you_mean(value: Any, choices: Sequence[str]) -> str:
    """Return " Did you mean 'x'?" for the closest choice, or an empty string.

    Of the similar choices, the fewest typing slips away wins (one swapped, missing, extra or wrong letter each),
    then the one of the same length: "dpp" is a slip of "ddp" as much as of "dp", but keeps the length of "ddp".
    """
    text = str(value).lower()
    close = difflib.get_close_matches(text, list(choices), n=3, cutoff=0.5)
    if not close:
        return ""
    best = min(close, key=lambda choice: (_slips(text, choice), abs(len(choice) - len(text))))
    return f" Did you mean {best!r}?"


def _slips(a: str, b: str) -> int:
    """Edits from ``a`` to ``b``, counting a swap of two neighbouring letters as one (optimal string alignment)."""
    previous2: list[int] = []
    previous = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        current = [i] + [0] * len(b)
        for j in range(1, len(b) + 1):
            cost = a[i - 1] != b[j - 1]
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                current[j] = min(current[j], previous2[j - 2] + 1)
        previous2, previous = previous, current
    return previous[-1]


def invalid_choice(what: str, value: Any, choices: Sequence[str]) -> ValueError:
    listed = ", ".join(repr(c) for c in choices)
    return ValueError(f"{what}={value!r} is not supported. Valid choices: {listed}.{did_you_mean(value, choices)}")


def parse_accelerator(accelerator: Any) -> str:
    """Return the lower-case accelerator name ("auto", "cpu", "cuda", "gpu" or "mps").

    Usage: ``parse_accelerator("CUDA") == "cuda"``.
    """
    if not isinstance(accelerator, str) or accelerator.lower() not in ACCELERATORS:
        raise invalid_choice("accelerator", accelerator, ACCELERATORS)
    return accelerator.lower()


def _strategy_spelling(strategy: Any) -> Any:
    # The strategy names live with their classes (fabriclite.strategies.parse_strategy checks them); here, where
    # Fabric's arguments meet `fabriclite run`'s, only the spelling matters: "FSDP" and "fsdp" are the same.
    return strategy.lower() if isinstance(strategy, str) else strategy


def parse_precision(precision: Any) -> str:
    """Return the canonical precision name, accepting Lightning's aliases (32, 64, 16, "bf16", "16", ...).

    Usage: ``parse_precision(16) == "16-mixed"``.
    """
    if precision is None:
        return "32-true"
    key = str(precision).lower() if isinstance(precision, (str, int)) and not isinstance(precision, bool) else None
    if key in PRECISIONS:
        return key
    if key in _PRECISION_ALIASES:
        return _PRECISION_ALIASES[key]
    raise invalid_choice("precision", precision, PRECISIONS + tuple(_PRECISION_ALIASES))


def parse_devices(devices: Any) -> int | list[int] | str:
    """Return ``"auto"``, ``-1`` (all), a positive count, or a list of device indices.

    Accepts what Lightning accepts: an int, a list or tuple of ints, "auto", "-1", "2", "0,1" and "0,".
    Usage: ``parse_devices("0,1") == [0, 1]``.
    """
    expected = 'a positive int, -1, a list of device indices, "auto", or a string such as "2", "-1" or "0,1"'
    original = devices
    if isinstance(devices, str):
        text = devices.strip().lower()
        if text == "auto":
            return "auto"
        try:
            if "," in text:
                devices = [int(part) for part in text.split(",") if part.strip()]
            else:
                devices = int(text)
        except ValueError:
            raise ValueError(f"devices={original!r} is not valid. Expected {expected}.") from None
    if isinstance(devices, bool):
        raise ValueError(f"devices={original!r} is not valid. Expected {expected}.")
    if isinstance(devices, int):
        if devices == -1 or devices > 0:
            return devices
        raise ValueError(f"devices={original!r} is not valid: use a positive count or -1 for all devices.")
    if (
        isinstance(devices, (list, tuple))
        and devices
        and all(isinstance(d, int) and not isinstance(d, bool) for d in devices)
    ):
        if any(d < 0 for d in devices) or len(set(devices)) != len(devices):
            raise ValueError(f"devices={original!r} is not valid: indices must be distinct and non-negative.")
        return list(devices)
    raise ValueError(f"devices={original!r} is not valid. Expected {expected}.")


def parse_num_nodes(num_nodes: Any) -> int:
    """Return ``num_nodes`` as a positive int. Usage: ``parse_num_nodes(2) == 2``."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r} is not valid: expected a positive int.")
    return num_nodes


# ---------------------------------------------------------------------------------------------- `fabriclite run`
# ``fabriclite run --precision bf16-mixed train.py`` exports ``FABRICLITE_CLI_PRECISION=bf16-mixed``; every process
# torchrun starts inherits it, and ``Fabric.__init__`` reads it through ``apply_cli_settings``.
ENV_PREFIX = "FABRICLITE_CLI_"

# The Fabric arguments the CLI may set, with Fabric's defaults: an argument left at its default takes the CLI's
# value. A precision of None is the only "not given" one, since Fabric(precision="32-true") may mean it.
FABRIC_DEFAULTS: dict[str, Any] = {
    "accelerator": "auto",
    "strategy": "auto",
    "devices": "auto",
    "num_nodes": 1,
    "precision": None,
}

# The parser of each setting the CLI shares with Fabric.
PARSERS: dict[str, Callable[[Any], Any]] = {
    "accelerator": parse_accelerator,
    "strategy": _strategy_spelling,
    "devices": parse_devices,
    "num_nodes": parse_num_nodes,
    "precision": parse_precision,
}


# A strategy setting the CLI may set too (``--state-dict-type``): the checkpoint format of the sharding strategies,
# by Lightning's argument name. The strategy's own default ("sharded") takes the CLI's value; another value conflicts.
STATE_DICT_TYPES = ("sharded", "full")


def parse_state_dict_type(value: Any) -> str:
    """Return "sharded" or "full", the checkpoint formats of FSDP and model parallelism (Lightning's
    ``state_dict_type``). Usage: ``parse_state_dict_type("Full") == "full"``."""
    if not isinstance(value, str) or value.lower() not in STATE_DICT_TYPES:
        raise invalid_choice("state_dict_type", value, STATE_DICT_TYPES)
    return value.lower()


def apply_cli_state_dict_type(strategy: Any) -> None:
    """Give ``strategy`` the checkpoint format ``fabriclite run --state-dict-type`` set, if any: a strategy at its
    default ("sharded") takes it; one given another, or one that only writes full checkpoints asked for "sharded",
    raises a ``ValueError`` naming both. Usage: ``apply_cli_state_dict_type(strategy)`` once it is built."""
    text = os.environ.get(env_name("state_dict_type"))
    if text is None:
        return
    from_cli = parse_state_dict_type(text)
    current = getattr(strategy, "state_dict_type", None)
    if current is None and from_cli == "sharded":
        raise ValueError(
            f"`fabriclite run --state-dict-type sharded` needs a strategy that shards the model (fsdp, or "
            f"ModelParallelStrategy); {type(strategy).__name__} writes full checkpoints only. Remove the option, or "
            "run with --strategy fsdp."
        )
    if current in (None, "sharded"):
        if current is not None:
            strategy.state_dict_type = from_cli
    elif current != from_cli:
        raise ValueError(
            f"state_dict_type={current!r} of {type(strategy).__name__} conflicts with `fabriclite run "
            f"--state-dict-type {text}`; remove one of them."
        )


def env_name(key: str) -> str:
    """The environment variable carrying one setting. Usage: ``env_name("num_nodes") == "FABRICLITE_CLI_NUM_NODES"``."""
    return ENV_PREFIX + key.upper()


def _parse_text(key: str, text: str) -> Any:
    if key == "num_nodes" and text.isdigit():  # the environment holds text
        return parse_num_nodes(int(text))
    return PARSERS[key](text)


def apply_cli_settings(
    accelerator: Any, strategy: Any, devices: Any, num_nodes: Any, precision: Any
) -> tuple[Any, Any, Any, Any, Any]:
    """Merge ``Fabric``'s arguments with what ``fabriclite run`` set; return them in the same order.

    An argument left at its default takes the CLI's value; one that means the same (``16`` and ``"16-mixed"``,
    ``"2"`` and ``2``) is fine; one that differs raises a ``ValueError`` naming both.
    Usage: ``accelerator, strategy, devices, num_nodes, precision = apply_cli_settings(...)``.
    """
    given = {
        "accelerator": accelerator,
        "strategy": strategy,
        "devices": devices,
        "num_nodes": num_nodes,
        "precision": precision,
    }
    for key, parse in PARSERS.items():
        text = os.environ.get(env_name(key))
        if text is None:
            continue
        from_cli = _parse_text(key, text)
        at_default = given[key] is None if key == "precision" else parse(given[key]) == parse(FABRIC_DEFAULTS[key])
        if at_default:
            given[key] = from_cli
        elif parse(given[key]) != from_cli:
            raise ValueError(
                f"{key}={given[key]!r} conflicts with `fabriclite run --{key.replace('_', '-')} {text}`; "
                "remove one of them."
            )
    return given["accelerator"], given["strategy"], given["devices"], given["num_nodes"], given["precision"]
