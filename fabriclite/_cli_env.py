"""The settings ``fabriclite run`` hands to the script's ``Fabric()``, through environment variables.

``fabriclite run --precision bf16-mixed train.py`` exports ``FABRICLITE_CLI_PRECISION=bf16-mixed``; every process
torchrun starts inherits it, and ``Fabric.__init__`` reads it here. Kept tiny because ``import fabriclite`` loads it.
"""

from __future__ import annotations

import os
from typing import Any, Callable

from fabriclite import choices

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


def _parse_num_nodes(value: Any) -> int:
    return choices.parse_num_nodes(int(value) if isinstance(value, str) and value.isdigit() else value)


_PARSERS: dict[str, Callable[[Any], Any]] = {
    "accelerator": choices.parse_accelerator,
    "strategy": choices.parse_strategy,
    "devices": choices.parse_devices,
    "num_nodes": _parse_num_nodes,  # the environment holds text
    "precision": choices.parse_precision,
}


def env_name(key: str) -> str:
    """The environment variable carrying one setting. Usage: ``env_name("num_nodes") == "FABRICLITE_CLI_NUM_NODES"``."""
    return ENV_PREFIX + key.upper()


def _is_default(key: str, value: Any) -> bool:
    if key == "precision":
        return value is None
    return _PARSERS[key](value) == _PARSERS[key](FABRIC_DEFAULTS[key])


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
    for key, parse in _PARSERS.items():
        text = os.environ.get(env_name(key))
        if text is None:
            continue
        from_cli = parse(text)
        if _is_default(key, given[key]):
            given[key] = from_cli
        elif parse(given[key]) != from_cli:
            raise ValueError(
                f"{key}={given[key]!r} conflicts with `fabriclite run --{key.replace('_', '-')} {text}`; "
                "remove one of them."
            )
    return given["accelerator"], given["strategy"], given["devices"], given["num_nodes"], given["precision"]
