"""The same seeded loop, raw and through Fabric, must end with bit-identical weights."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabriclite import Fabric, seed_everything


def build():
    seed_everything(7, verbose=False)
    model = nn.Sequential(
        nn.Linear(10, 32), nn.GELU(), nn.Dropout(0.3), nn.Linear(32, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4)
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    data = TensorDataset(torch.randn(150, 10), torch.randint(0, 4, (150,)))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    return model, optimizer, loader


def train_raw(precision, epochs=3):
    model, optimizer, loader = build()
    for _ in range(epochs):
        for x, y in loader:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
                out = model(x)
            loss = F.cross_entropy(out.float(), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.state_dict()


def train_fabric(precision, epochs=3):
    model, optimizer, loader = build()
    fabric = Fabric(accelerator="cpu", devices=1, precision=precision)
    fabric.launch()
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(loader)
    for _ in range(epochs):
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
    return model.state_dict()


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_fabric_loop_ends_bit_identical_to_the_raw_loop(precision):
    raw, fab = train_raw(precision), train_fabric(precision)
    assert raw.keys() == fab.keys()
    for key in raw:
        assert torch.equal(raw[key], fab[key]), f"{key} differs"


def test_parity_check_detects_a_different_loop():
    # Guards the test above: one extra epoch must show up as a difference.
    raw, fab = train_raw("32-true", epochs=3), train_fabric("32-true", epochs=2)
    assert not all(torch.equal(raw[k], fab[k]) for k in raw)


def test_setup_dataloaders_yields_exactly_the_raw_batches():
    _, _, raw_loader = build()
    raw_batches = [b for _ in range(2) for b in raw_loader]
    _, _, loader = build()
    wrapped = Fabric(accelerator="cpu").setup_dataloaders(loader)
    batches = [b for _ in range(2) for b in wrapped]
    assert len(batches) == len(raw_batches) == 2 * len(wrapped)
    for (x1, y1), (x2, y2) in zip(raw_batches, batches):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)


def test_setup_dataloaders_returns_one_loader_or_a_list():
    _, _, a = build()
    _, _, b = build()
    fabric = Fabric(accelerator="cpu")
    out = fabric.setup_dataloaders(a, b)
    assert isinstance(out, list) and len(out) == 2
    assert len(out[0]) == len(a)
    assert out[0].batch_size == 16  # attributes pass through


def test_setup_dataloaders_refuses_non_loaders_and_double_setup():
    fabric = Fabric(accelerator="cpu")
    with pytest.raises(TypeError, match="DataLoader"):
        fabric.setup_dataloaders([1, 2, 3])
    _, _, loader = build()
    wrapped = fabric.setup_dataloaders(loader)
    with pytest.raises(ValueError, match="should be passed only once"):
        fabric.setup_dataloaders(wrapped)
    with pytest.raises(ValueError, match="at least one"):
        fabric.setup_dataloaders()
