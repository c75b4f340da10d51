"""What the compatibility scripts share, kept out of the scripts so each reads like Lightning's docs teach."""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def regression_data(n: int = 64, features: int = 8) -> TensorDataset:
    generator = torch.Generator().manual_seed(7)
    x = torch.randn(n, features, generator=generator)
    y = x @ torch.linspace(-1, 1, features) + 0.1 * torch.randn(n, generator=generator)
    return TensorDataset(x, y.unsqueeze(1))


def mlp(features: int = 8) -> nn.Module:
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, 1))


class Block(nn.Module):
    """The repeated block of the FSDP scripts: the class their wrap and checkpointing policies name."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(x))


def loader(batch_size: int = 8, shuffle: bool = True) -> DataLoader:
    return DataLoader(regression_data(), batch_size=batch_size, shuffle=shuffle)


def report(fabric, step: int, loss: torch.Tensor) -> None:
    """Print the loss averaged over ranks, from rank 0: the line the test compares between implementations."""
    mean = fabric.all_reduce(loss.detach(), reduce_op="mean")
    if fabric.global_rank == 0:
        print(f"LOSS {step} {mean.item():.10f}", flush=True)
