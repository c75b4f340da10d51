"""A compact Vision Transformer for small images, written from scratch with torch.nn.

The layout follows the original ViT (Dosovitskiy et al., 2020) in its pre-norm form:

    image -> patches -> linear embedding -> [CLS] + tokens + position embedding
          -> depth x Block(LayerNorm -> attention -> residual, LayerNorm -> MLP -> residual)
          -> LayerNorm -> CLS token -> linear head

Usage:
    model = ViT(ViTConfig(image_size=8, patch_size=4, num_classes=10))
    logits = model(images)  # images: (batch, channels, 8, 8) -> logits: (batch, 10)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ViTConfig:
    """Shape of a ViT. The defaults suit the 8x8 grayscale scikit-learn digits.

    With 4x4 patches an 8x8 digit is 4 tokens (plus CLS). 2x2 patches (16 tokens) cost 2.5x more per
    step in fp32 (5x under CPU bf16 autocast, whose flash-attention backward is slow at this size) and
    learned more slowly per step on this data. Dropout is off: in the demo's few hundred steps, 0.1
    cost accuracy rather than adding it.
    """

    image_size: int = 8
    patch_size: int = 4
    in_channels: int = 1
    dim: int = 64
    depth: int = 4
    heads: int = 4
    mlp_ratio: int = 4
    num_classes: int = 10
    dropout: float = 0.0

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    def flops(self, training: bool = True) -> int:
        """Model FLOPs of one image through this ViT: its forward, or with ``training`` its forward and backward
        (the backward computes two products for each of the forward's, one for the patch convolution: the images
        need no gradient). Worked out from the shapes, with no pass run, and equal to what ``measure_flops``
        (torch's FLOP counter) counts on the model: 2 FLOPs per multiply-add of the matrix products, the patch
        convolution and attention; norms, activations and the softmax are not counted. The one count every ViT
        MFU of the examples and benchmarks uses.

        Usage: ``ViTConfig(image_size=224, patch_size=16, in_channels=3, dim=768, depth=12, heads=12).flops()``
        (105.1e9, ViT-B/16 at 224x224).
        """
        tokens, dim = self.num_patches + 1, self.dim  # the patches and the CLS token
        patches = 2 * self.num_patches * self.in_channels * self.patch_size**2 * dim
        attention = 2 * tokens * dim * 3 * dim + 2 * 2 * tokens * tokens * dim + 2 * tokens * dim * dim
        mlp = 2 * 2 * tokens * dim * self.mlp_ratio * dim
        forward = patches + self.depth * (attention + mlp) + 2 * dim * self.num_classes  # the head sees CLS only
        return 3 * forward - patches if training else forward


# The numbered scripts 00-09 use a wider, deeper ViT than the demo: at this width the matrix products
# dominate a step, and bf16 autocast runs them about 1.5x faster than fp32 on a CPU with AVX-512 BF16
# (at the demo's width 64, bf16 was slower: the per-op overhead dominates there).
SERIES_CONFIG = ViTConfig(dim=256, depth=6, heads=8)


class Attention(nn.Module):
    """Multi-head self-attention over all tokens (no mask: every patch may look at every other)."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        assert config.dim % config.heads == 0, f"dim={config.dim} must be divisible by heads={config.heads}"
        self.heads = config.heads
        self.dropout = config.dropout
        # One matmul for query, key and value is faster than three small ones.
        self.qkv = nn.Linear(config.dim, 3 * config.dim)
        self.proj = nn.Linear(config.dim, config.dim)
        self.proj_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, heads, T, head_dim), the layout scaled_dot_product_attention expects.
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        # The fused op picks a kernel for the device (flash attention, on CPU too), which need not keep
        # the (T, T) attention weights for backward. Dropout on those weights is for training only, and
        # unlike nn.Dropout this functional call does not see model.eval() by itself.
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj_dropout(self.proj(y))


class MLP(nn.Module):
    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        hidden = config.mlp_ratio * config.dim
        self.fc = nn.Linear(config.dim, hidden)
        self.proj = nn.Linear(hidden, config.dim)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: normalising before each sub-layer keeps the residual stream
    un-normalised, which trains stably without a learning-rate warmup at this size."""

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.dim)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.dim)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class ViT(nn.Module):
    """Vision Transformer classifier.

    Usage:
        model = ViT(ViTConfig(num_classes=4))
        model.load_state_dict(torch.load("vit.pt", weights_only=True))
        model.reset_head(10)  # fine-tune the same backbone on a 10-class task
    """

    def __init__(self, config: ViTConfig) -> None:
        super().__init__()
        assert config.image_size % config.patch_size == 0, (
            f"image_size={config.image_size} must be a multiple of patch_size={config.patch_size}"
        )
        # A private copy, so that reset_head() can update it without touching a config the caller shares.
        self.config = replace(config)
        # A convolution with stride == kernel size is exactly "cut into patches, flatten, apply
        # one linear layer", in a single fused op.
        self.patch_embed = nn.Conv2d(
            config.in_channels, config.dim, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.cls_token = nn.Parameter(torch.zeros(1, 1, config.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, config.num_patches + 1, config.dim))
        self.dropout = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.depth)])
        self.ln_f = nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, config.num_classes)
        self.apply(self._init_weights)
        # Small random position embeddings break the symmetry between patches from the first step.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.trunc_normal_(self.cls_token, std=0.02)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            nn.init.trunc_normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def reset_head(self, num_classes: int) -> None:
        """Replace the classification head with a freshly initialised one for `num_classes` classes.

        Usage: ``model.reset_head(10)`` after loading weights pretrained on another task.
        """
        self.config.num_classes = num_classes
        device, dtype = self.head.weight.device, self.head.weight.dtype
        self.head = nn.Linear(self.config.dim, num_classes, device=device, dtype=dtype)
        self._init_weights(self.head)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)  # (B, dim, H/p, W/p)
        x = x.flatten(2).transpose(1, 2)  # (B, num_patches, dim)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.dropout(x)
        for block in self.blocks:
            x = block(x)
        # The CLS token has attended to every patch; it alone summarises the image for the head.
        return self.head(self.ln_f(x[:, 0]))


def load_pretrained(path: Path, config: ViTConfig, num_classes: int) -> ViT:
    """Build a ViT from a pretrained state dict (.pt or .safetensors) and give it a fresh head.

    Usage: ``model = load_pretrained(Path("vit_pretrained.pt"), ViTConfig(), num_classes=10)``.
    """
    if not path.exists():
        sys.exit(
            f"no pretrained weights at {path}. Make them with `python examples/vit/pretrain.py"
            f"{' --series' if config == SERIES_CONFIG else ''}` (minutes on a CPU), or pass --weights PATH."
        )
    if path.suffix == ".safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError:
            sys.exit(f"{path} is a safetensors file: `pip install safetensors` to read it, or pass a .pt file.")
        state = load_file(str(path))
    else:
        # weights_only: unpickling can run arbitrary code, and a state dict needs nothing but tensors.
        state = torch.load(path, map_location="cpu", weights_only=True)

    # The pretraining head has as many outputs as its task needed; build the model to match the file
    # exactly, so that a strict load catches weights made for another architecture.
    if "head.weight" not in state:
        sys.exit(f"{path} has no 'head.weight': it is not a state dict of examples/vit/model.py's ViT.")
    model = ViT(replace(config, num_classes=state["head.weight"].shape[0]))
    try:
        model.load_state_dict(state)
    except RuntimeError as err:
        sys.exit(f"{path} does not fit {config}:\n{err}\nPretrain again, or pass --weights.")
    model.reset_head(num_classes)
    return model
