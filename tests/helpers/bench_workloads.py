"""User workload factories for ``paratrain bench`` tests (``--workload bench_workloads:linear_tuple``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
from torch.nn import functional as F

from paratrain.workloads import Workload


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


class LabelsModel(nn.Module):
    """A transformers-shaped model: ``model(x, labels=y)`` returns an output whose ``.loss`` is the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> SimpleNamespace:
        logits = self.linear(x)
        return SimpleNamespace(logits=logits, loss=None if labels is None else F.cross_entropy(logits, labels))


def own_loss_nanogpt() -> Workload:
    """nanoGPT's GPT, which computes its own loss: ``model(idx, targets) -> (logits, loss)``; no loss function."""
    from helpers.nanogpt_shaped import tiny

    return Workload(
        name="nanogpt-own-loss",
        model=tiny,
        loss=None,
        make_batch=lambda n, g: tuple(torch.randint(0, 512, (2, n, 16), generator=g)),
    )


def own_loss_labels() -> tuple:
    """The short form with a model's own ``labels=`` loss: targets are keyword targets."""
    torch.manual_seed(0)
    return (
        LabelsModel(),
        None,
        lambda n, g: (torch.randn(n, 4, generator=g), {"labels": torch.randint(0, 2, (n,), generator=g)}),
    )
