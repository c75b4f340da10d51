"""DDP on 2 processes sharing one device, over gloo (NCCL refuses two ranks on one GPU). Prints "PASS <rank> <name>"
or "FAIL <rank> <name>: <why>" per check.

Started as a plain ``python``, this process starts the second rank with the variables a launcher sets, as if each
rank were a node of one device (``devices=1, num_nodes=2``: so both use device 0), and becomes rank 0 itself.

Usage: ``python tests/cuda/ddp_two_ranks_one_device.py cuda|cpu``.
"""

import os
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from cuda_checks import fixed_batch, report, small_model
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric, seed_everything
from fabriclite.plugins.environments import free_port
from fabriclite.strategies import DDPStrategy

STEPS = 3


def run(accelerator: str) -> bool:
    strategy = DDPStrategy(process_group_backend="gloo", timeout=timedelta(seconds=90))
    fabric = Fabric(accelerator=accelerator, devices=1, num_nodes=2, strategy=strategy)
    fabric.launch()
    rank = fabric.global_rank
    expected_device = torch.device("cuda", 0) if accelerator == "cuda" else torch.device("cpu")

    def layout() -> None:
        assert (fabric.world_size, dist.get_backend()) == (2, "gloo"), (fabric.world_size, dist.get_backend())
        assert fabric.device == expected_device, f"rank {rank} runs on {fabric.device}"

    def collectives() -> None:
        total = fabric.all_reduce(torch.tensor([rank + 1.0], device=fabric.device), reduce_op="sum")
        assert total.device == fabric.device and total.item() == 3.0, total
        gathered = fabric.all_gather(torch.tensor([rank, 10 + rank], device=fabric.device))
        assert torch.equal(gathered.cpu(), torch.tensor([[0, 10], [1, 11]])), gathered

    def data_is_sharded() -> None:
        loader = fabric.setup_dataloaders(DataLoader(TensorDataset(torch.arange(20.0)), batch_size=5))
        mine = torch.cat([batch[0] for batch in loader])
        assert mine.device == fabric.device and len(mine) == 10, mine
        everyone = fabric.all_gather(mine).flatten().cpu()
        assert sorted(everyone.tolist()) == list(range(20)), everyone

    def ddp_equals_one_process_on_the_whole_batch() -> None:
        seed_everything(0, verbose=False)
        model = small_model(dropout=0.0)
        reference = small_model(dropout=0.0).to(fabric.device)
        reference.load_state_dict(model.state_dict())
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        x, y = fixed_batch(fabric.device)
        half = slice(rank * 16, (rank + 1) * 16)
        for _ in range(STEPS):
            loss = F.cross_entropy(model(x[half]), y[half])
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            reference_loss = F.cross_entropy(reference(x), y)  # every rank computes the whole batch alone
            reference_optimizer.zero_grad()
            reference_loss.backward()
            reference_optimizer.step()
        mine = torch.cat([p.detach().flatten() for p in model.parameters()])
        both = fabric.all_gather(mine)
        assert torch.equal(both[0], both[1]), "the ranks' weights differ"
        alone = torch.cat([p.detach().flatten() for p in reference.parameters()])
        torch.testing.assert_close(mine, alone, rtol=1e-5, atol=1e-6)

    passed = report("two ranks share the device over gloo", layout, rank)
    passed &= report("all_reduce and all_gather of device tensors", collectives, rank)
    passed &= report("each rank reads half the data", data_is_sharded, rank)
    passed &= report("DDP equals one process on the whole batch", ddp_equals_one_process_on_the_whole_batch, rank)
    fabric.barrier()
    return passed


def main() -> int:
    accelerator = sys.argv[1]
    if "RANK" in os.environ:  # the second rank
        return 0 if run(accelerator) else 1
    ranks = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    other = subprocess.Popen(
        [sys.executable, __file__, *sys.argv[1:]], env={**os.environ, **ranks, "RANK": "1", "NODE_RANK": "1"}
    )
    os.environ.update(ranks, RANK="0", NODE_RANK="0")
    try:
        passed = run(accelerator)
    finally:
        try:
            code = other.wait(timeout=120)
        except subprocess.TimeoutExpired:
            other.kill()
            code = other.wait()
    return 0 if passed and code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
