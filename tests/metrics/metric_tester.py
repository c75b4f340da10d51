"""The shared metric tester: random inputs fed in uneven batches, every value compared to scikit-learn.

``check_metric`` feeds a metric batch by batch through ``forward`` and demands that each returned value equal the
reference on that batch, that ``compute()`` equal the reference on all the data, and that the functional form
agree too. References are plain functions of numpy arrays (``preds``, ``target``) built on scikit-learn; the
helpers below turn scores into the labels scikit-learn expects, the way the metrics do.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

Reference = Callable[[np.ndarray, np.ndarray], Any]


# ---------------------------------------------------------------------------------------------------- inputs


def rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def uneven_sizes(total: int, seed: int, batches: int = 6) -> list[int]:
    """Batch sizes summing to ``total``, deliberately uneven (a batch of one sample among them)."""
    cuts = np.sort(rng(seed).choice(np.arange(2, total), size=batches - 2, replace=False))
    sizes = np.diff(np.concatenate([[0, 1], cuts, [total]])).tolist()
    return [int(s) for s in sizes]


def split(tensors: tuple[torch.Tensor, ...], sizes: list[int]) -> list[tuple[torch.Tensor, ...]]:
    parts = [torch.split(t, sizes) for t in tensors]
    return list(zip(*parts))


def binary_inputs(n: int, seed: int, kind: str = "probs") -> tuple[torch.Tensor, torch.Tensor]:
    r = rng(seed)
    target = torch.from_numpy(r.integers(0, 2, n))
    if kind == "labels":
        return torch.from_numpy(r.integers(0, 2, n)), target
    scores = torch.from_numpy(r.random(n).astype(np.float32))
    # logits correlated with the target, so that curves are not all chance
    return (torch.logit(scores) + target) if kind == "logits" else scores, target


def multiclass_inputs(
    n: int, num_classes: int, seed: int, kind: str = "logits", absent: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``absent``: a class that appears in neither preds nor target."""
    r = rng(seed)
    classes = [c for c in range(num_classes) if c != absent]
    target = torch.from_numpy(r.choice(classes, n))
    if kind == "labels":
        return torch.from_numpy(r.choice(classes, n)), target
    logits = torch.from_numpy(r.normal(size=(n, num_classes)).astype(np.float32))
    logits[torch.arange(n), target] += 1.0
    if absent is not None:
        logits[:, absent] = -1e4
    return (logits.softmax(1) if kind == "probs" else logits), target


def multilabel_inputs(n: int, num_labels: int, seed: int, kind: str = "probs") -> tuple[torch.Tensor, torch.Tensor]:
    r = rng(seed)
    target = torch.from_numpy(r.integers(0, 2, (n, num_labels)))
    if kind == "labels":
        return torch.from_numpy(r.integers(0, 2, (n, num_labels))), target
    scores = torch.from_numpy(r.random((n, num_labels)).astype(np.float32))
    return (torch.logit(scores) if kind == "logits" else scores), target


def regression_inputs(n: int, seed: int, outputs: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    r = rng(seed)
    shape = (n,) if outputs == 1 else (n, outputs)
    target = torch.from_numpy((r.normal(size=shape) * 3 + 5).astype(np.float32))
    return target + torch.from_numpy(r.normal(size=shape).astype(np.float32)), target


# ------------------------------------------------------------------------------------- what scikit-learn sees


def sigmoid_if_logits(scores: np.ndarray) -> np.ndarray:
    """The metrics' rule: scores outside [0, 1] are logits."""
    if scores.size and (scores.min() < 0 or scores.max() > 1):
        return 1 / (1 + np.exp(-scores.astype(np.float64)))
    return scores


def softmax_if_logits(scores: np.ndarray) -> np.ndarray:
    if scores.size and (scores.min() < 0 or scores.max() > 1):
        shifted = np.exp(scores - scores.max(1, keepdims=True))
        return shifted / shifted.sum(1, keepdims=True)
    return scores


def labels_of(preds: np.ndarray, task: str, threshold: float = 0.5) -> np.ndarray:
    """Hard labels from the inputs, as the count-based metrics derive them."""
    if not np.issubdtype(preds.dtype, np.floating):
        return preds
    if task == "multiclass":
        return preds.argmax(1)
    return (sigmoid_if_logits(preds) > threshold).astype(np.int64)


def drop_ignored(preds: np.ndarray, target: np.ndarray, ignore_index: int | None) -> tuple[np.ndarray, np.ndarray]:
    if ignore_index is None:
        return preds, target
    keep = target != ignore_index
    return preds[keep], target[keep]


def per_label(
    score: Callable[[np.ndarray, np.ndarray], float],
    preds: np.ndarray,
    target: np.ndarray,
    average: str | None,
    ignore_index: int | None = None,
) -> Any:
    """A binary scikit-learn score applied per label of multilabel data, skipping ignored entries, then averaged
    (``micro``: all kept entries as one binary problem; ``weighted``: by positives)."""
    valid = np.ones_like(target, dtype=bool) if ignore_index is None else target != ignore_index
    if average == "micro":
        return score(target[valid], preds[valid])
    scores = np.array([score(target[valid[:, j], j], preds[valid[:, j], j]) for j in range(target.shape[1])])
    if average in (None, "none"):
        return scores
    if average == "weighted":
        support = np.array([(target[valid[:, j], j] == 1).sum() for j in range(target.shape[1])])
        return (scores * support).sum() / support.sum()
    return scores.mean()


# ------------------------------------------------------------------------------------------------- comparing


def to_numpy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu().double().numpy()
    if isinstance(value, (list, tuple)):
        return type(value)(to_numpy(v) for v in value)
    return np.asarray(value, dtype=np.float64)


def assert_close(actual: Any, expected: Any, atol: float = 1e-6, what: str = "") -> None:
    """Numbers, arrays, tensors, and lists / tuples / dicts of them, compared element by element."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and set(actual) == set(expected), (
            f"{what}: keys {set(actual)} vs {set(expected)}"
        )
        for key in expected:
            assert_close(actual[key], expected[key], atol, f"{what}[{key!r}]")
        return
    actual = to_numpy(actual)
    if isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{what}: {actual} vs {expected}"
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, atol, f"{what}[{i}]")
        return
    np.testing.assert_allclose(actual, np.asarray(expected, dtype=np.float64), rtol=1e-5, atol=atol, err_msg=what)


def check_metric(
    metric: Any,
    inputs: tuple[torch.Tensor, torch.Tensor],
    reference: Reference,
    sizes: list[int],
    functional: Callable[..., Any] | None = None,
    atol: float = 1e-6,
    check_batches: bool = True,
) -> None:
    """forward's value on every batch, compute() on all the data, and the functional form equal the reference."""
    for i, batch in enumerate(split(inputs, sizes)):
        value = metric(*batch)
        if check_batches:
            assert_close(value, reference(*(t.numpy() for t in batch)), atol, f"batch {i} (size {sizes[i]})")
    expected = reference(*(t.numpy() for t in inputs))
    assert_close(metric.compute(), expected, atol, "compute() over all batches")
    if functional is not None:
        assert_close(functional(*inputs), expected, atol, "functional form")
