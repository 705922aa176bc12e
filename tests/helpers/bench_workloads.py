"""User workload factories for ``paratrain bench`` tests (``--workload bench_workloads:linear_tuple``)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def linear_tuple():
    """The short form: (model, loss, make_batch)."""
    torch.manual_seed(0)
    return (
        nn.Linear(4, 2),
        F.cross_entropy,
        lambda n, g: (torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)),
    )


def wrong():
    return "a model"
