import io
import re
import sys

import pytest
import torch

from fabriclite.progress import progress


class NotATerminal(io.StringIO):
    def isatty(self):
        return False


class Terminal(io.StringIO):
    def isatty(self):
        return True


class ItemCountingTensor:
    """Stands in for a GPU tensor: counts .item() calls, the per-step sync the bar must avoid when off."""

    calls = 0

    def item(self):
        ItemCountingTensor.calls += 1
        return 0.5


def test_bar_is_disabled_off_a_terminal_and_yields_the_identical_items(monkeypatch):
    monkeypatch.setattr(sys, "stderr", NotATerminal())
    items = [torch.ones(2), {"x": torch.zeros(3)}, "text", None, 7]
    bar = progress(items, desc="train")
    out = list(bar)
    assert not bar.enabled
    assert len(out) == len(items)
    assert all(got is expected for got, expected in zip(out, items))
    assert sys.stderr.getvalue() == ""


def test_disabled_bar_hands_out_the_iterables_own_iterator():
    items = [1, 2, 3]
    assert type(iter(progress(items, enable=False))) is type(iter(items))


def test_bar_is_enabled_on_a_terminal_by_default(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress([1, 2])
    assert bar.enabled
    assert list(bar) == [1, 2]
    assert "2/2" in sys.stderr.getvalue()


def test_enable_false_disables_the_bar_even_on_a_terminal(monkeypatch):
    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress([1, 2], enable=False)
    assert list(bar) == [1, 2]
    assert sys.stderr.getvalue() == ""


def test_enabled_bar_shows_samples_per_second_and_the_set_metrics():
    file = io.StringIO()
    batches = [(torch.randn(8, 3), torch.zeros(8)) for _ in range(4)]
    bar = progress(batches, desc="train", enable=True, file=file)
    out = []
    for batch in bar:
        out.append(batch)
        bar.set_metrics(loss=torch.tensor(0.123456), lr=1e-3, epoch=2)
    assert all(got is expected for got, expected in zip(out, batches)) and len(out) == 4
    last_line = file.getvalue().strip().split("\r")[-1]
    assert last_line.startswith("train: 100%")
    assert "4/4" in last_line
    assert "loss=0.1235" in last_line
    assert "lr=0.001" in last_line
    assert "epoch=2" in last_line
    assert re.search(r"samples/s=\d+\.\d", last_line)


def final_samples_per_second(batches, monkeypatch):
    # A fake clock ticking 1 ms per read: runs of equal length take equal time, whatever the machine.
    clock = iter(range(1000))
    monkeypatch.setattr("fabriclite.progress.time.perf_counter", lambda: next(clock) / 1000)
    file = io.StringIO()
    list(progress(batches, enable=True, file=file))
    return float(re.findall(r"samples/s=([\d.]+)", file.getvalue())[-1])


def test_samples_per_second_counts_the_first_dimension_of_the_first_tensor(monkeypatch):
    one_per_batch = final_samples_per_second(["a", "b", "c"], monkeypatch)
    nested = [{"meta": "a", "inputs": [torch.zeros(16, 2), torch.zeros(4)]}] * 3
    scalar_first = [(torch.tensor(1.0), torch.zeros(4, 2))] * 3
    assert final_samples_per_second(nested, monkeypatch) == 16 * one_per_batch
    assert final_samples_per_second(scalar_first, monkeypatch) == 4 * one_per_batch


def test_a_batch_without_tensors_counts_as_one_sample(monkeypatch):
    one_row_per_batch = final_samples_per_second([torch.zeros(1, 5)] * 3, monkeypatch)
    assert final_samples_per_second(["a", "b", "c"], monkeypatch) == one_row_per_batch
    assert final_samples_per_second([[1, 2, 3]] * 3, monkeypatch) == one_row_per_batch


def test_set_metrics_calls_no_item_when_the_bar_is_disabled():
    ItemCountingTensor.calls = 0
    bar = progress(range(5), enable=False)
    for _ in bar:
        bar.set_metrics(loss=ItemCountingTensor())
    assert ItemCountingTensor.calls == 0


def test_set_metrics_formats_tensors_only_when_the_postfix_refreshes(monkeypatch):
    clock = iter([0.0] + [0.01 * i for i in range(1, 1000)])  # 10 ms per step: ~5 refreshes a second
    monkeypatch.setattr("fabriclite.progress.time.perf_counter", lambda: next(clock))
    ItemCountingTensor.calls = 0
    bar = progress(range(100), enable=True, file=io.StringIO())
    for _ in bar:
        bar.set_metrics(loss=ItemCountingTensor())
    assert 1 <= ItemCountingTensor.calls <= 10


def test_len_passes_through_to_the_iterable():
    assert len(progress(range(7), enable=True, file=io.StringIO())) == 7
    assert len(progress([1, 2, 3], enable=False)) == 3


def test_len_of_an_iterable_without_length_raises_type_error():
    with pytest.raises(TypeError):
        len(progress(iter([1, 2]), enable=False))


def test_total_can_be_given_for_an_iterable_without_length():
    file = io.StringIO()
    list(progress(iter([1, 2, 3]), total=3, enable=True, file=file))
    assert "3/3" in file.getvalue()


def test_breaking_out_of_the_loop_closes_the_bar():
    file = io.StringIO()
    bar = progress(range(10), enable=True, file=file)
    iterator = iter(bar)
    next(iterator)
    iterator.close()
    assert file.getvalue().endswith("\n")  # tqdm writes the final newline only when the bar is closed
