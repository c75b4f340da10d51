"""The blocks of a model that repeat (a transformer's layers): the regions ``compile=True`` compiles once for all
siblings, and the units FSDP shards by default."""

from __future__ import annotations

from collections import Counter

from torch import nn


def repeated_blocks(module: nn.Module) -> list[nn.Module]:
    """The blocks that repeat: children of an ``nn.ModuleList``/``nn.Sequential`` whose class (with parameters)
    appears there more than once, outermost only (a block's own layers are not searched).

    Usage: ``repeated_blocks(vit)`` -> the transformer blocks.
    """
    blocks: list[nn.Module] = []

    def visit(parent: nn.Module) -> None:
        repeated: set[type] = set()
        if isinstance(parent, (nn.ModuleList, nn.Sequential)):
            counts = Counter(type(c) for c in parent.children() if next(c.parameters(), None) is not None)
            repeated = {cls for cls, n in counts.items() if n > 1}
        for child in parent.children():
            if type(child) in repeated:
                blocks.append(child)
            else:
                visit(child)

    visit(module)
    return blocks
