"""The scikit-learn digits data set as PyTorch datasets.

1797 grayscale 8x8 images of handwritten digits, 10 classes, bundled with scikit-learn: nothing is
downloaded. The split into train / val / test is stratified and fixed by a seed, so every run, the
pretraining included, sees the same test images, and the pretraining never sees them.

Usage:
    train, val, test = load_digits_splits()
    image, label = train[0]  # image: float32 (1, 8, 8) in [0, 1], label: int64 scalar
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import TensorDataset

# Fractions of the whole data set; the rest (70%) is the training split.
VAL_FRACTION = 0.1
TEST_FRACTION = 0.2
SPLIT_SEED = 0
NUM_CLASSES = 10


def _import_sklearn_digits():
    # scikit-learn is not a dependency of fabriclite itself, only of this example and the tests.
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as err:
        raise ImportError(
            "This example needs scikit-learn for its bundled digits data set (nothing is downloaded). "
            "Install it with:  pip install scikit-learn"
        ) from err
    return load_digits, train_test_split


def load_digits_splits(
    seed: int = SPLIT_SEED, train_per_class: int | None = None
) -> tuple[TensorDataset, TensorDataset, TensorDataset]:
    """Return the digits as (train, val, test) TensorDatasets of (image, label) pairs.

    Images are float32 tensors of shape (N, 1, 8, 8) scaled to [0, 1]; labels are int64 in 0..9.
    The 70/10/20 split is stratified by class and depends only on `seed`. With `train_per_class`, the
    training split keeps only that many labelled images of each class (the first ones of the split).

    Usage: ``train, val, test = load_digits_splits(train_per_class=20)``
    """
    load_digits, train_test_split = _import_sklearn_digits()
    digits = load_digits()
    # Pixel values are integers 0..16 (counts of set pixels in 4x4 blocks of the original 32x32 scans).
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)

    rest_x, test_x, rest_y, test_y = train_test_split(
        images, labels, test_size=TEST_FRACTION, stratify=labels, random_state=seed
    )
    train_x, val_x, train_y, val_y = train_test_split(
        rest_x, rest_y, test_size=VAL_FRACTION / (1 - TEST_FRACTION), stratify=rest_y, random_state=seed
    )

    if train_per_class is not None:
        if train_per_class < 1:
            raise ValueError(f"train_per_class must be at least 1, got {train_per_class}")
        keep = np.concatenate([np.flatnonzero(train_y == label)[:train_per_class] for label in range(NUM_CLASSES)])
        keep.sort()
        train_x, train_y = train_x[keep], train_y[keep]

    def to_dataset(x: np.ndarray, y: np.ndarray) -> TensorDataset:
        return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))

    return to_dataset(train_x, train_y), to_dataset(val_x, val_y), to_dataset(test_x, test_y)
