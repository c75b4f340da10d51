"""Seeding every global generator at once, and each DataLoader worker from it; capturing and restoring the global
random streams, for checkpoints (every rank resumes drawing the same numbers) and a resumed loader's epoch."""

from __future__ import annotations

import functools
import logging
import os
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from fabriclite.rank_zero import rank_zero_warn

_MAX_SEED = 2**32 - 1
log = logging.getLogger("fabriclite.utilities.seed")


def seed_everything(seed: Any = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed Python's ``random``, NumPy and torch (CPU and every CUDA device); return the seed used.

    ``seed`` is anything ``int()`` takes (a NumPy integer, a float, a string of digits), between 0 and 2**32 - 1.
    ``seed=None`` reads the ``PL_GLOBAL_SEED`` environment variable, else uses 0 with a "No seed found" warning. The
    seed is exported in ``PL_GLOBAL_SEED`` and ``workers`` in ``PL_SEED_WORKERS`` (Lightning's variables, and only
    those) so processes launched later see them. With ``workers=True`` (``fabric.seed_everything``'s default), ``fabric.setup_dataloaders`` gives loaders
    without a ``worker_init_fn`` ``pl_worker_init_function``, which seeds ``random``, NumPy and torch in each
    worker from the loader's base seed, the worker and the global rank. "Seed set to N" is logged at INFO on the
    ``fabriclite.utilities.seed`` logger (Lightning's logger name with the import swapped).
    Usage: ``seed_everything(42)``.
    """
    if seed is None:
        name = "PL_GLOBAL_SEED"
        text = os.environ.get(name)
        if text is None:
            seed = 0
            if verbose:
                rank_zero_warn(f"No seed found, seed set to {seed}")
        else:
            try:
                seed = int(text)
            except ValueError:
                raise ValueError(f"Invalid seed specified via {name}: {text!r} is not an integer.") from None
    elif isinstance(seed, bool):  # an int to Python (Lightning seeds 1), but most likely meant as workers=True
        raise ValueError(f"seed={seed!r} is not valid: expected an int between 0 and {_MAX_SEED} (or workers={seed}?).")
    elif not isinstance(seed, int):
        try:
            seed = int(seed)  # as Lightning: np.int64(3), 3.7 and "3" give 3
        except (TypeError, ValueError) as error:  # the type Lightning's bare int() raises
            expected = f"expected an int between 0 and {_MAX_SEED}, or what int() turns into one"
            raise type(error)(f"seed={seed!r} is not valid: {expected}.") from None
    if not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed={seed} is not in bounds: NumPy accepts seeds from 0 to {_MAX_SEED}.")
    if verbose:
        log.info(f"{_rank_prefix()}Seed set to {seed}")
    os.environ["PL_GLOBAL_SEED"] = str(seed)
    os.environ["PL_SEED_WORKERS"] = str(int(workers))
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    return seed


def _rank_prefix() -> str:
    # "[rank: N] " where several processes print the same line (as Lightning's message); nothing on one process.
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        try:
            rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        except ValueError:
            return ""
    return f"[rank: {rank}] " if world_size > 1 else ""


def reset_seed() -> None:
    """Seed again with the seed (and ``workers`` choice) ``seed_everything`` last exported, if any.

    Usage: ``reset_seed()`` in a process that must start from the same random state as its launcher.
    """
    seed = os.environ.get("PL_GLOBAL_SEED")
    if seed is not None:
        seed_everything(int(seed), workers=os.environ.get("PL_SEED_WORKERS", "0") == "1", verbose=False)


def pl_worker_init_function(worker_id: int, rank: int | None = None) -> None:
    """Seed ``random``, NumPy and torch in a DataLoader worker from the loader's base seed, ``worker_id`` and the
    global ``rank`` (by default ``RANK`` from the environment), so that workers, and the same worker on different
    ranks, draw different numbers, and a run with the same seed draws them again. The seeds are those Lightning
    2.6.1 and later derive.

    Usage: ``DataLoader(..., worker_init_fn=functools.partial(pl_worker_init_function, rank=fabric.global_rank))``;
    ``fabric.setup_dataloaders`` installs it after ``seed_everything(seed, workers=True)``.
    """
    global_rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    base_seed = torch.initial_seed() - worker_id  # the DataLoader seeds worker i with base + i
    torch_seed, random_high, random_low, _ = _mixed_seeds(base_seed, worker_id, global_rank, count=4)
    torch.manual_seed(torch_seed)
    random.seed((random_high << 32) | random_low)
    np.random.seed(np.random.SeedSequence([base_seed, worker_id, global_rank]).generate_state(4))


def _mixed_seeds(base_seed: int, worker_id: int, global_rank: int, count: int) -> list[int]:
    # The three numbers packed into one, its bits spread by MurmurHash3's 64-bit finalizer, then a linear
    # congruential generator (Knuth's MMIX constants) stepped once per seed.
    mask = (1 << 64) - 1
    x = (base_seed << 32) | (worker_id << 16) | global_rank
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        x ^= x >> 33
        x = (x * multiplier) & mask
    x ^= x >> 33
    seeds = []
    for _ in range(count):
        x = (x * 6364136223846793005 + 1) & mask
        seeds.append(x)
    return seeds


def worker_init_function(current: Callable[[int], None] | None, global_rank: int) -> Callable[[int], None] | None:
    """The ``worker_init_fn`` a loader should have: ``pl_worker_init_function`` for this rank when
    ``seed_everything(..., workers=True)`` asked for it and the loader has none, else ``current`` unchanged.

    Usage: ``loader.worker_init_fn = worker_init_function(loader.worker_init_fn, fabric.global_rank)``.
    """
    if current is not None or os.environ.get("PL_SEED_WORKERS") != "1":
        return current
    return functools.partial(pl_worker_init_function, rank=global_rank)  # a partial pickles into worker processes


def capture_rng_state() -> dict[str, Any]:
    """Return the state of Python's, NumPy's, torch's and (when initialized) CUDA's global generators.

    Only tensors and plain Python values, so the result loads with ``torch.load(weights_only=True)``.
    Usage: ``state = capture_rng_state(); ...; restore_rng_state(state)``.
    """
    kind, key, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "key": torch.from_numpy(key.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put the global generators back to a state from ``capture_rng_state``."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["key"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _loader_generators(loader: DataLoader) -> dict[str, torch.Generator]:
    """The torch generators a loader's shuffling may draw from, by where they sit (shared ones named once)."""
    found: dict[str, torch.Generator] = {}
    seen: set[int] = set()
    for where, owner in (
        ("loader", loader),
        ("sampler", getattr(loader, "sampler", None)),
        ("batch_sampler", getattr(loader, "batch_sampler", None)),
        ("batch_sampler.sampler", getattr(getattr(loader, "batch_sampler", None), "sampler", None)),
        ("sampler.source", getattr(getattr(loader, "sampler", None), "source", None)),  # a sharded user's sampler
    ):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and id(generator) not in seen:
            seen.add(id(generator))
            found[where] = generator
    return found


def capture_loader_rng(loader: DataLoader) -> dict[str, Any]:
    """The global random streams and those of the generators a loader's shuffling draws from, which together decide
    the order of its next epoch. Usage: ``state = capture_loader_rng(loader); ...; restore_loader_rng(loader, state)``."""
    return {
        "global": capture_rng_state(),
        "generators": {where: g.get_state() for where, g in _loader_generators(loader).items()},
    }


def restore_loader_rng(loader: DataLoader, state: dict[str, Any]) -> None:
    """Put back the global random streams and the loader's generators from ``capture_loader_rng``."""
    restore_rng_state(state["global"])
    generators = _loader_generators(loader)
    for where, value in state["generators"].items():
        if where in generators:
            generators[where].set_state(value)
