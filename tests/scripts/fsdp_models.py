"""A small ViT-like model for the FSDP checks: repeated transformer blocks, a custom init applied after
construction (so the order of random draws matters), and a non-persistent buffer computed in ``__init__``."""

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, dropout: float) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(2 * dim, dim))
        self.heads = 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(
        self, dim: int = 16, depth: int = 3, tokens: int = 4, patch: int = 8, classes: int = 3, dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.embed = nn.Linear(patch, dim)
        self.position = nn.Parameter(torch.zeros(1, tokens, dim))
        self.blocks = nn.ModuleList(Block(dim, dropout) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)
        self.register_buffer("offset", torch.linspace(-1, 1, tokens)[None, :, None], persistent=False)
        nn.init.trunc_normal_(self.position, std=0.02)
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
            nn.init.zeros_(module.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.position + self.offset
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h).mean(1))
