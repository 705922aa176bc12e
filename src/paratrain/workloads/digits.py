"""scikit-learn's bundled handwritten digits (1,797 8x8 images; no download) and a small CNN for them."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from ..errors import ConfigError


def load_digits_split(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """Train and test sets: images scaled to [0, 1] as (1, 8, 8) float tensors, integer labels.

    The split is a fixed permutation of ``seed``, so every rank (and every run) sees the same split.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise ConfigError("the digits demo needs scikit-learn: pip install 'paratrain[demo]'") from None
    bunch = load_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(bunch.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


DIGITS_TP_PLAN = {"6": "colwise", "8": "rowwise"}
"""Tensor parallelism for ``digits_cnn``: its hidden linear layer split by columns, the classifier by rows (one
all-reduce of the 10 logits); the convolutions stay whole on every rank."""


def digits_cnn(channels: int = 16, hidden: int = 128, classes: int = 10) -> nn.Sequential:
    """Two 3x3 conv layers, a pooling step and two linear layers: ~75k parameters, >97% test accuracy.

    A flat ``nn.Sequential`` of nine layers (a plain one: slicing it into pipeline stages keeps its class), so
    every strategy can run it, pipelines included.
    """
    return nn.Sequential(
        nn.Conv2d(1, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * 16, hidden),
        nn.ReLU(),
        nn.Linear(hidden, classes),
    )
