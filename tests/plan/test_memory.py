"""The plan's memory count (``fabriclite/plan/memory.py``) on real tensors, where the truth is known: each storage
counts once from its creation until it is freed, memory torch did not allocate does not count, and the kinds learnt
after the peak still sort the storages that were alive at it."""

import torch

from fabriclite.plan.memory import KINDS, MemoryTracker


def test_a_storage_counts_once_from_creation_until_freed_and_views_add_nothing():
    tracker = MemoryTracker()
    with tracker:
        a = torch.empty(1000, dtype=torch.float32)
        view = a[10:20].view(2, 5)
        assert tracker.bytes == 4000
        b = torch.empty(500, dtype=torch.float64)
        assert tracker.bytes == 8000
        del a  # the view keeps the storage alive
        assert tracker.bytes == 8000
        del view
        assert tracker.bytes == 4000
        del b
    assert tracker.bytes == 0 and tracker.setup_peak == 8000


def test_memory_torch_did_not_allocate_is_not_counted():
    data = bytearray(4096)
    tracker = MemoryTracker()
    with tracker:
        window = torch.frombuffer(data, dtype=torch.uint8)[100:200]  # a view of Python's bytes
        copy = window.clone()  # this one torch allocates
    assert tracker.setup_peak == 100 and copy.numel() == 100


def test_kinds_learnt_after_the_peak_sort_the_storages_that_were_alive_at_it():
    model = torch.nn.Linear(100, 100)  # 10,100 fp32 parameters: 40,400 bytes
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tracker = MemoryTracker()
    with tracker:
        tracker.on_first_forward(model)  # the parameters were made before: they count from now
        hidden = model(torch.ones(50, 100))  # input 20,000 bytes, output 20,000 bytes
        hidden.sum().backward()  # gradients: made here, known as such only at the step
        tracker.on_step_start(optimizer, [model])
        optimizer.step()  # momentum buffers: 40,400 bytes, known at the step's end
        tracker.on_step_end(optimizer)
    by_kind = tracker.peak_by_kind()
    assert list(by_kind) == list(KINDS)
    assert by_kind["parameters"] == 40_400
    assert by_kind["gradients"] == 40_400
    assert by_kind["optimizer state"] == 40_400  # the peak is at the step, when all three are alive
    assert sum(by_kind.values()) == tracker.step_peak


def test_tensors_a_collective_touches_are_collective_buffers():
    tracker = MemoryTracker()
    with tracker:
        tracker.stepping = True
        bucket = torch.zeros(256)
        tracker.mark([bucket], "collective buffers")
        tracker.mark([bucket], "activations and temporaries")  # a later kind cannot demote it
    assert tracker.peak_by_kind()["collective buffers"] == 1024
