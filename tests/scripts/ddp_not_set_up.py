"""DDP on 2 processes: an optimizer over a model that was not set up is refused in setup and setup_optimizers; the
first fabric.backward refuses a loss that comes from no set-up model (touching no gradient) and warns about a loose
parameter beside a set-up model; the check runs once, not per step. Prints "PASS <rank> <name>".

Usage: `python ddp_not_set_up.py`.
"""

import warnings

import torch
from check_report import report
from torch import nn

from fabriclite import Fabric


def started():
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    return fabric


def raised(call, *args):
    try:
        call(*args)
    except (ValueError, RuntimeError) as error:
        return error
    return None


fabric = started()
rank = fabric.global_rank
forgotten = nn.Linear(4, 2)
error = raised(fabric.setup_optimizers, torch.optim.SGD(forgotten.parameters(), lr=0.1))
report(
    rank,
    "setup_optimizers refuses an optimizer over a model that was not set up",
    isinstance(error, ValueError) and "2 parameter(s) of shapes [2, 4], [2]" in str(error),
    repr(error),
)
error = raised(fabric.setup, nn.Linear(4, 2), torch.optim.SGD(forgotten.parameters(), lr=0.1))
report(
    rank,
    "setup refuses an optimizer over another model than the one set up",
    isinstance(error, ValueError) and "no model set up with fabric.setup" in str(error),
    repr(error),
)

model = fabric.setup(nn.Linear(4, 2))
error = raised(fabric.backward, forgotten(torch.randn(3, 4)).sum())
report(
    rank,
    "backward refuses a loss from a model that was not set up",
    isinstance(error, RuntimeError) and "This loss comes from 2 parameter(s)" in str(error),
    repr(error),
)
report(rank, "and touches no gradient", forgotten.weight.grad is None and model.weight.grad is None)

fabric = started()
model = fabric.setup(nn.Linear(4, 2))
temperature = nn.Parameter(torch.ones(()))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fabric.backward((model(torch.randn(3, 4)) * temperature).sum())
report(
    rank,
    "backward warns about a loose parameter beside a set-up model",
    any("1 parameter(s) of shapes []" in str(w.message) for w in caught),
    [str(w.message) for w in caught],
)

fabric = started()
model = nn.Linear(4, 2)
model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
checks = []
check_loss = fabric.strategy.check_loss
fabric.strategy.check_loss = lambda loss: (checks.append(1), check_loss(loss))
for _ in range(3):
    optimizer.zero_grad()
    fabric.backward(model(torch.randn(3, 4)).sum())
    optimizer.step()
report(rank, "a model set up with its optimizer trains, checked on the first backward only", checks == [1], checks)
fabric.barrier()
print(f"DONE {rank}", flush=True)
