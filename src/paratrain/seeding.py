"""Seeds: the same model initialisation on every rank, different random streams for data per rank."""
from __future__ import annotations

import random

import numpy as np
import torch


def seed_all(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and every CUDA device) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device


def rank_seed(seed: int, rank: int) -> int:
    """A per-rank seed derived from ``seed``: distinct across ranks, stable across runs."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1, dtype=np.uint64)[0] % 2**63)
