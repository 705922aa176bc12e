"""Seeds: the same model initialisation on every rank, different random streams for data per rank; and
deterministic kernels, so that two runs of the same job on a GPU can be compared bit for bit."""

from __future__ import annotations

import os
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


def use_deterministic_kernels() -> None:
    """Make GPU runs repeatable bit for bit: cuDNN's deterministic algorithms, a fixed cuBLAS workspace, and
    torch's deterministic implementations (a warning, not an error, where an op has none).

    On CUDA the default kernels differ from run to run (cuDNN picks algorithms by timing, some backward kernels
    add with atomics): two identical runs end with different parameters. CPU kernels are already repeatable.
    Call it before the first CUDA work: cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when it starts.
    """
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.use_deterministic_algorithms(True, warn_only=True)
