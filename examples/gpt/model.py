"""A small GPT over bytes, in the style of nanoGPT: one file, read top to bottom.

    bytes -> token embedding + position embedding
          -> n_layer x Block(LayerNorm -> causal self-attention -> residual, LayerNorm -> MLP -> residual)
          -> LayerNorm -> linear head sharing the token embedding's weights -> logits over the 256 byte values

``GPTConfig(llama=True)`` makes the blocks Llama's: RMSNorm, rotary position embedding (RoPE) on queries and keys
instead of a position embedding, and a SwiGLU MLP. ``GPT(config, kernels=True)`` runs RoPE and SwiGLU on
fabriclite's Triton kernels, and ``fused_loss=True`` the loss as its linear cross-entropy, which never holds all the
logits at once: less memory, a slower step (on one H200 a 389M-parameter GPT with a 32768-token vocabulary stepped
1.62x slower with it, faster with RoPE's and SwiGLU's kernels: BENCHMARKS.md). The norms are swapped by
``Fabric(kernels=True)``.

Usage:
    model = GPT(GPTConfig())
    logits = model(idx)  # idx: (batch, time) int64 bytes -> logits: (batch, time, 256)
    loss = model(idx, targets)  # the mean cross-entropy per byte
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
    llama: bool = False  # RMSNorm, RoPE and SwiGLU instead of LayerNorm, a position embedding and a GELU MLP


class Ops:
    """The functions the blocks call, from torch or from fabriclite's Triton kernels: RoPE and SwiGLU with
    ``kernels=True``, the loss with ``fused_loss=True``."""

    def __init__(self, kernels: bool, fused_loss: bool = False) -> None:
        self.rope, self.swiglu, self.linear_cross_entropy = rope_torch, swiglu_torch, linear_cross_entropy_torch
        if kernels:
            from fabriclite.kernels import rope, swiglu

            self.rope, self.swiglu = rope, swiglu
        if fused_loss:
            from fabriclite.kernels import linear_cross_entropy

            self.linear_cross_entropy = linear_cross_entropy


def rope_torch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Llama's rotate-half RoPE on (B, T, heads, head_size) queries and keys; cos, sin: (T, head_size)."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over the heads
    q_rot, k_rot = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    return q_rot.to(q.dtype), k_rot.to(k.dtype)  # fp32 tables must not promote bf16 queries and keys


def swiglu_torch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.silu(a) * b


def linear_cross_entropy_torch(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str = "mean"
) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight), targets, reduction=reduction)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0, f"n_embd={config.n_embd} must be divisible by n_head={config.n_head}"
        self.head_size = config.n_embd // config.n_head
        self.llama = config.llama
        if config.llama:  # RoPE tables, recomputed rather than saved (persistent=False): they follow from the shape
            inv_freq = 1.0 / 10000 ** (torch.arange(0, self.head_size, 2).float() / self.head_size)
            angles = torch.outer(torch.arange(config.block_size).float(), inv_freq).repeat(1, 2)  # (T, head_size)
            self.register_buffer("cos", angles.cos(), persistent=False)
            self.register_buffer("sin", angles.sin(), persistent=False)
        # Query, key and value as three projections, so tensor parallelism can give each rank whole heads of each
        # (examples/gpt/parallel.py); one fused (C, 3C) matmul would be split across q, k and v instead.
        self.c_q = nn.Linear(config.n_embd, config.n_embd)
        self.c_k = nn.Linear(config.n_embd, config.n_embd)
        self.c_v = nn.Linear(config.n_embd, config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: all of them, or under tensor parallelism this rank's share.
        q, k, v = (proj(x).view(B, T, -1, self.head_size) for proj in (self.c_q, self.c_k, self.c_v))
        if self.llama:
            q, k = ops.rope(q, k, self.cos[:T], self.sin[:T])
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, heads, T, head_size)
        # is_causal masks the future inside the fused kernel (flash attention where the device has one), so the
        # (T, T) mask and attention weights are never materialised.
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, heads, T, head_size)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # SwiGLU has a third matrix, so its hidden width is 2/3 of GELU's (as Llama), rounded up to a multiple of 16.
        hidden = -(-8 * config.n_embd // 3 // 16) * 16 if config.llama else 4 * config.n_embd
        self.c_gate = nn.Linear(config.n_embd, hidden) if config.llama else None
        self.c_fc = nn.Linear(config.n_embd, hidden)
        self.c_proj = nn.Linear(hidden, config.n_embd)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        if self.c_gate is not None:
            return self.c_proj(ops.swiglu(self.c_gate(x), self.c_fc(x)))
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    """Pre-norm: each sub-layer sees a normalised input and adds to an un-normalised residual stream."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        # Plain torch norms on purpose: Fabric(kernels=True) swaps these for fabriclite's fused Triton ones.
        norm = nn.RMSNorm if config.llama else nn.LayerNorm
        self.ln_1 = norm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = norm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, ops: Ops) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), ops)
        x = x + self.mlp(self.ln_2(x), ops)
        return x


class GPT(nn.Module):
    """A decoder-only transformer over bytes; returns logits, the loss is the training script's business.

    Usage:
        model = GPT(GPTConfig(n_layer=2, n_embd=64))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    """

    def __init__(self, config: GPTConfig, kernels: bool = False, fused_loss: bool = False) -> None:
        super().__init__()
        self.config = config
        self.ops = Ops(kernels, fused_loss)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = None if config.llama else nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.ln_f = nn.RMSNorm(config.n_embd) if config.llama else nn.LayerNorm(config.n_embd)
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

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, reduction: str = "mean") -> torch.Tensor:
        """The logits, or with ``targets`` the cross-entropy (computed here, where the head's weight is whole
        even under FSDP; with kernels, from the final hidden states without materialising the logits)."""
        T = idx.shape[1]
        assert T <= self.config.block_size, f"sequence of {T} bytes is longer than block_size={self.config.block_size}"
        x = self.wte(idx)
        if self.wpe is not None:
            x = x + self.wpe(torch.arange(T, device=idx.device))
        for block in self.blocks:
            x = block(x, self.ops)
        x = self.ln_f(x)
        if targets is None:
            return self.lm_head(x)
        return self.ops.linear_cross_entropy(
            x.flatten(0, 1), self.lm_head.weight, targets.flatten(), reduction=reduction
        )

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
