"""Which rows of the current batch are padding: the contract between the data loader and the metrics.

``DistributedSampler`` repeats a few indices so that every rank gets the same number of samples; those repeated
rows would be counted twice by a metric synced across ranks. The loader marks them here before yielding each batch,
and ``Metric.update`` drops them, so a metric under DDP gives the single-process answer.

Usage::

    set_padding(torch.tensor([False, False, True]))  # the loader, before yielding a batch of 3
    current_padding()                                # a metric's update: which rows to drop
    set_padding(None)                                # the loader, when iteration ends

A plain global rather than something threaded through the batch: the loop body between two yields is the only
code that may read it, and keeping it out of the batch leaves the user's tensors untouched.
"""

from __future__ import annotations

import torch

_padding: torch.Tensor | None = None


def set_padding(mask: torch.Tensor | None) -> None:
    """Mark rows of the batch about to be yielded as padding (``True`` = a duplicate), or clear the mark with ``None``.

    Usage: ``set_padding(torch.tensor([False, True]))``. Keep the mask on the CPU: metrics read it on every update.
    """
    global _padding
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.ndim != 1:
            got = (
                f"{mask.dtype} tensor of shape {tuple(mask.shape)}"
                if isinstance(mask, torch.Tensor)
                else type(mask).__name__
            )
            raise TypeError(
                f"set_padding expects a 1-D bool tensor (one entry per row of the batch) or None, got {got}"
            )
    _padding = mask


def current_padding() -> torch.Tensor | None:
    """The padding mask of the current batch, or ``None`` outside a marked batch.

    Usage: ``mask = current_padding()``.
    """
    return _padding
