"""Seeding every global generator at once."""

from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch

_MAX_SEED = 2**32 - 1


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's ``random``, NumPy and torch (CPU and every CUDA device); return the seed used.

    ``seed=None`` reads the ``FABRICLITE_GLOBAL_SEED`` (or Lightning's ``PL_GLOBAL_SEED``) environment variable,
    else uses 0. The seed is exported in both variables so processes launched later see it. ``workers`` is
    accepted for compatibility: PyTorch already seeds ``random``, NumPy and torch in each DataLoader worker from
    the loader's base seed, which seeding here makes reproducible.
    Usage: ``seed_everything(42)``.
    """
    if seed is None:
        text = os.environ.get("FABRICLITE_GLOBAL_SEED", os.environ.get("PL_GLOBAL_SEED", "0"))
        try:
            seed = int(text)
        except ValueError:
            raise ValueError(f"The seed in the environment, {text!r}, is not an integer.") from None
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed={seed!r} is not valid: expected an int between 0 and {_MAX_SEED}.")
    if verbose:
        print(f"Seed set to {seed}", file=sys.stderr)
    os.environ["FABRICLITE_GLOBAL_SEED"] = os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(workers))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed
