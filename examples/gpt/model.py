"""A small GPT over bytes, in the style of nanoGPT: one file, read top to bottom.

    bytes -> token embedding + position embedding
          -> n_layer x Block(LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP -> residual)
          -> LayerNorm -> linear head sharing the token embedding's weights -> logits over the 256 byte values

Usage:
    model = GPT(GPTConfig())
    logits = model(idx)  # idx: (batch, time) int64 bytes -> logits: (batch, time, 256)
    out = model.generate(idx, max_new_tokens=200, temperature=0.8, top_k=40)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    """Shape of a GPT. The defaults (0.8M parameters) train at a few thousand tokens/s on a laptop CPU core."""

    block_size: int = 128  # context length in bytes
    vocab_size: int = 256  # one token per byte value: no tokenizer to train, download or ship
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0, f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}"
        self.head_size = config.n_embd // config.n_head
        # Query, key and value as three projections, so tensor parallelism can give each rank whole heads of each
        # (examples/gpt/parallel.py); one fused (C, 3C) matmul would be split across q, k and v instead.
        self.c_q = nn.Linear(config.n_embd, config.n_embd)
        self.c_k = nn.Linear(config.n_embd, config.n_embd)
        self.c_v = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: all of them, or under tensor parallelism this rank's share.
        q, k, v = (proj(x).view(B, T, -1, self.head_size).transpose(1, 2) for proj in (self.c_q, self.c_k, self.c_v))
        # is_causal masks the future inside the fused kernel (flash attention where the device has one), so the
        # (T, T) mask and attention weights are never materialised.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head_size)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm: each sub-layer sees a normalised input and adds to an un-normalised residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # Plain nn.LayerNorm on purpose: Fabric(kernels=True) swaps these for fabriclite's fused Triton layer norm.
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    """A decoder-only transformer over bytes; returns logits, the loss is the training script's business.

    Usage:
        model = GPT(GPTConfig(n_layer=2, n_embd=64))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying (Press & Wolf, 2017): the byte that is read and the byte that is predicted share one
        # vector, which saves parameters and trains faster at this size.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        # GPT-2's scaled init: each block adds two projections to the residual stream, so shrink them with depth
        # to keep its variance from growing with n_layer.
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        assert T <= self.config.block_size, f"sequence of {T} bytes is longer than block_size={self.config.block_size}"
        pos = torch.arange(T, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Append ``max_new_tokens`` sampled bytes to ``idx`` (batch, time), feeding the model its own output.

        Only the ``top_k`` most likely bytes are kept (None keeps all); a temperature below 1 sharpens the rest.
        Usage: ``out = model.generate(torch.tensor([list(b"def ")]), 100, temperature=0.8, top_k=40)``.
        """
        for _ in range(max_new_tokens):
            context = idx[:, -self.config.block_size :]  # the model has no positions beyond block_size
            logits = self(context)[:, -1, :].float() / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_byte = torch.multinomial(F.softmax(logits, dim=-1), num_samples=1, generator=generator)
            idx = torch.cat([idx, next_byte], dim=1)
        return idx
