"""DDPStrategy and FSDPStrategy through the Strategy interface alone (no Fabric), on 2 real processes started by the
strategy's own launcher; prints "PASS <rank> <name>" per check. Usage: ``python strategy_checks.py ddp|fsdp``.
"""

import os
import sys
import tempfile

import torch
from check_report import report
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabriclite.accelerators import CPUAccelerator
from fabriclite.strategies import DDPStrategy, FSDPStrategy


def run(strategy, folder):
    strategy.setup_environment()
    rank = strategy.global_rank
    report(rank, "layout", (strategy.world_size, strategy.local_rank) == (2, rank))

    # Collectives.
    report(rank, "broadcast", strategy.broadcast(f"from {rank}") == "from 0")
    report(rank, "all_gather_object", strategy.all_gather_object(rank * 10) == [0, 10])
    mean = strategy.all_reduce(torch.tensor(rank + 1), reduce_op="mean")
    report(rank, "all_reduce mean of integers is a float", mean.dtype == torch.float32 and mean.item() == 1.5)
    uneven = strategy.all_gather(torch.arange(rank * 2 + 1))
    report(rank, "all_gather of uneven lengths", [t.tolist() for t in uneven] == [[0], [0, 1, 2]])

    # Data: each rank its shard.
    loader = strategy.process_dataloader(DataLoader(TensorDataset(torch.arange(10)), batch_size=2), True)
    mine = torch.cat([batch[0] for batch in loader])
    everyone = torch.cat(strategy.all_gather(mine).unbind())
    report(rank, "the shards cover the data once", sorted(everyone.tolist()) == list(range(10)))

    # The module: gradients averaged across ranks.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
    strategy.module_to_device(model)
    model = strategy.setup_module(model)
    model(torch.full((2, 4), float(rank + 1))).sum().backward()
    grads = torch.cat(
        [
            p.grad.full_tensor().flatten() if hasattr(p.grad, "full_tensor") else p.grad.flatten()
            for p in model.parameters()
        ]
    )
    gathered = strategy.all_gather(grads)
    report(rank, "gradients are averaged across ranks", torch.allclose(gathered[0], gathered[1]))

    # A checkpoint through the strategy, read back through the strategy.
    path = os.path.join(folder, "ckpt")
    strategy.save_checkpoint(path, {"model": model, "step": 7}, meta={"written_by": rank})
    state = {"model": model, "step": 0}
    remainder, meta = strategy.load_checkpoint(path, state)
    report(rank, "a checkpoint round-trips", state["step"] == 7 and remainder == {} and meta == {"written_by": 0})
    strategy.teardown()
    return rank


if __name__ == "__main__":
    kind = sys.argv[1]
    strategy = {"ddp": DDPStrategy, "fsdp": FSDPStrategy}[kind](start_method="spawn")
    strategy.configure(CPUAccelerator([0, 1]))
    with tempfile.TemporaryDirectory() as folder:
        result = strategy.launcher.launch(run, strategy, folder)
    report(0, "rank 0's result comes back", result == 0)
    os.write(1, b"DONE\n")
