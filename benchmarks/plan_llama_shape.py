"""A training script for the examples' GPT at a Llama-3-8B shape (32 blocks 4,096 wide, 32 heads, RMSNorm, RoPE,
SwiGLU, a 128,256-token vocabulary, 8,192 tokens of context: 6.96B parameters; Llama-3-8B's own 8.03B has grouped
keys and values and an untied head, which this GPT does not), meant to be planned, not run: on this machine it would
need 28 GB for its weights alone. ``benchmarks/plan_memory.py`` times ``fabriclite plan`` on it.

``--hsdp`` shards over the devices of a node and replicates across nodes (HSDP, FSDPStrategy's hybrid sharding on
its default (nodes, devices) mesh); ``--tp`` splits each block over the devices of a node (the example's
``parallel.py``) and shards with FSDP2 across nodes (ModelParallelStrategy's default sizes).

Usage: ``fabriclite plan --devices 8 --num-nodes 128 --strategy fsdp benchmarks/plan_llama_shape.py --empty-init``;
``fabriclite plan --devices 8 --num-nodes 128 benchmarks/plan_llama_shape.py --empty-init --tp``.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "gpt"))
from model import GPT, GPTConfig  # noqa: E402
from parallel import parallelize  # noqa: E402

from fabriclite import Fabric  # noqa: E402
from fabriclite.strategies import FSDPStrategy, ModelParallelStrategy  # noqa: E402

LLAMA_3_8B = GPTConfig(block_size=8192, vocab_size=128256, n_layer=32, n_head=32, n_embd=4096, llama=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--empty-init", action="store_true", help="build under fabric.init_module(empty_init=True)")
    layout = parser.add_mutually_exclusive_group()
    layout.add_argument("--hsdp", action="store_true", help="shard within a node, replicate across nodes")
    layout.add_argument("--tp", action="store_true", help="tensor parallel within a node x FSDP2 across nodes")
    args = parser.parse_args()
    strategy = "auto"  # what `fabriclite plan --strategy` says
    if args.hsdp:
        strategy = FSDPStrategy(sharding_strategy="HYBRID_SHARD")
    elif args.tp:
        strategy = ModelParallelStrategy(parallelize)
    fabric = Fabric(strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    with fabric.init_module(empty_init=args.empty_init or None):
        model = GPT(LLAMA_3_8B)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model, optimizer = fabric.setup(model, optimizer)
    tokens = torch.randint(0, LLAMA_3_8B.vocab_size, (args.batch_size, LLAMA_3_8B.block_size + 1))
    x, y = fabric.to_device(tokens[:, :-1]), fabric.to_device(tokens[:, 1:])
    for _ in range(3):
        loss = model(x, y)
        fabric.backward(loss)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad()


if __name__ == "__main__":
    main()
