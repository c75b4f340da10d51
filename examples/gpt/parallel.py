"""Tensor parallel x FSDP2 for the GPT (`train.py --tp N`), composed as torchtitan does: tensor parallelism first,
inside each block, then FSDP2 over the data-parallel ranks, block by block and finally the root.

Tensor parallel (Megatron-style): q, k, v and the MLP's up projection are split by output columns (each rank holds
whole heads and a slice of the hidden units), the attention and MLP output projections by input rows, so each
sub-layer costs one all-reduce of its output in forward and one in backward. Embeddings, layer norms and the tied
head stay whole within a tensor-parallel group and are sharded by FSDP2 alone.

Usage: ``Fabric(devices=4, strategy=ModelParallelStrategy(parallelize, data_parallel_size=2, tensor_parallel_size=2))``.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

BLOCK_PLAN = {
    "mlp.c_gate": ColwiseParallel(),  # Llama-style blocks only
    "attn.c_q": ColwiseParallel(),
    "attn.c_k": ColwiseParallel(),
    "attn.c_v": ColwiseParallel(),
    "attn.c_proj": RowwiseParallel(),
    "mlp.c_fc": ColwiseParallel(),
    "mlp.c_proj": RowwiseParallel(),
}


def parallelize(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """Apply tensor parallelism on ``mesh["tensor_parallel"]``, then FSDP2 on ``mesh["data_parallel"]``."""
    for block in model.blocks:
        present = dict(block.named_modules())
        plan = {name: style for name, style in BLOCK_PLAN.items() if name in present}
        parallelize_module(block, mesh["tensor_parallel"], plan)
    for block in model.blocks:
        fully_shard(block, mesh=mesh["data_parallel"])
    return fully_shard(model, mesh=mesh["data_parallel"])
