"""A DLRM-like recommender: one big ``nn.EmbeddingBag`` table summing a few ids per sample, then an MLP; random ids
and labels. The workload where a parameter server pays off: a step reads a few rows of the table, while ddp
all-reduces the table's whole gradient (see ``paratrain bench --strategies ddp,ps`` and benchmarks/ps.py).

``recommender`` is the benchmark's size (1 M x 32 rows, 122 MiB); ``recommender-tiny`` (2^18 x 16, 16 MiB: still
large enough for ps's ``tables="auto"`` to hold it row-sharded on the servers) keeps tests cheap.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .workload import Batch, Workload


class Recommender(nn.Module):
    """ids (batch, ``ids``) → logits (batch, 2): the bag's sum of ``ids`` rows of a ``rows`` x ``dim`` table, then
    an MLP ``dim``-``hidden``-``hidden``-2."""

    def __init__(self, rows: int = 1_000_000, dim: int = 32, hidden: int = 256) -> None:
        super().__init__()
        self.table = nn.EmbeddingBag(rows, dim, mode="sum")
        self.mlp = nn.Sequential(
            nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 2)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.table(ids))


def adagrad(params) -> torch.optim.Optimizer:
    """Adagrad, lr 0.01: what recommenders train their tables with; it leaves the rows a step did not read as
    they are, so a parameter server may update only the rows it is sent."""
    return torch.optim.Adagrad(params, lr=0.01)


def recommender_workload(
    rows: int = 1_000_000, dim: int = 32, hidden: int = 256, ids: int = 8, name: str = "recommender"
) -> Workload:
    def make_batch(samples: int, generator: torch.Generator) -> Batch:
        return (
            torch.randint(0, rows, (samples, ids), generator=generator),
            torch.randint(0, 2, (samples,), generator=generator),
        )

    table_mib = rows * dim * 4 / 2**20
    return Workload(
        name=name,
        model=lambda: Recommender(rows, dim, hidden),
        loss=F.cross_entropy,
        make_batch=make_batch,
        optimizer=adagrad,
        description=f"recommender (DLRM-like): EmbeddingBag {rows:,} x {dim} ({table_mib:.0f} MiB) summing "
        f"{ids} random ids per sample + MLP {dim}-{hidden}-{hidden}-2, Adagrad",
    )


def recommender_tiny_workload() -> Workload:
    return recommender_workload(rows=1 << 18, dim=16, hidden=64, name="recommender-tiny")
