"""The training step the resume scripts share: it draws from every global random stream (Python's, NumPy's,
torch's), so a resume that restored any of them wrongly shows in the weights."""

import random

import numpy as np
import torch
import torch.nn.functional as F


def noisy_step(fabric, model, optimizer, x, y):
    x = x + 0.01 * torch.randn_like(x) * (1 + random.random()) * (1 + float(np.random.rand()))
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    fabric.backward(loss)
    optimizer.step()
