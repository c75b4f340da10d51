"""Under FSDP2 on 2 processes, compile=... compiles each sharded block in place (the root stays eager; with
regional=False each block, then the root) without graph breaks, and trains like the uncompiled model. With the
argument ``ddp``: the same under DDP (regional=False compiles around the DDP wrapper). Prints "PASS <rank> <name>"
per check."""

import os
import sys

import torch
from torch import nn

from fabriclite import Fabric


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x):
        return x + self.linear(self.norm(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block() for _ in range(3)])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(fabric, compile):
    torch.manual_seed(0)
    net = Net()
    model, optimizer = fabric.setup(net, torch.optim.SGD(net.parameters(), lr=0.1), compile=compile)
    torch.manual_seed(1 + fabric.global_rank)
    for _ in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
    return net, [(p.full_tensor() if strategy == "fsdp" else p).detach() for p in net.parameters()]


strategy = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
fabric.launch()
rank = fabric.global_rank
plain_net, plain = train(fabric, False)
compiled_net, compiled = train(fabric, {"backend": "aot_eager"})
whole_net, whole = train(fabric, {"backend": "aot_eager", "regional": False})


def check(name, condition):
    if not condition:
        raise AssertionError(f"rank {rank}: {name} failed")
    os.write(1, f"PASS {rank} {name}\n".encode())  # one write: ranks share the pipe


check("every block is compiled", all(block._compiled_call_impl is not None for block in compiled_net.blocks))
check("the root stays eager", compiled_net._compiled_call_impl is None)
if strategy == "fsdp":
    check(
        "regional=False compiles every block and the root",
        all(module._compiled_call_impl is not None for module in [*whole_net.blocks, whole_net]),
    )
else:
    check(
        "regional=False compiles around DDP", [r["compiled"] for r in fabric.compile_report()] == ["regional", "whole"]
    )
# Compiled whole around DDP, Dynamo breaks the graph in DDP's own forward (3 breaks on torch 2.13, gloo): the
# regional form has none.
reports = fabric.compile_report() if strategy == "fsdp" else fabric.compile_report()[:1]
check("no graph breaks", all(report["graph_breaks"] == 0 for report in reports))
check(
    "compiled training equals eager",
    all(torch.allclose(a, b, atol=1e-6) and torch.allclose(a, c, atol=1e-6) for a, b, c in zip(plain, compiled, whole)),
)
del plain_net, compiled_net, whole_net  # free the sharded models before exit (gloo may abort at exit otherwise)
