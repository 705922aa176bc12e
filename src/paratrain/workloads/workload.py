"""What a workload is: a model builder, a loss and a seeded batch maker (named in :mod:`.registry`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError

Batch = tuple[torch.Tensor, torch.Tensor]
MakeBatch = Callable[[int, torch.Generator], Batch]
"""``make_batch(samples, generator) -> (inputs, targets)``: random data drawn from ``generator``."""


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """The default optimizer of a workload: plain SGD, lr 0.01 (cheap, so the step time is the model's)."""
    return torch.optim.SGD(params, lr=0.01)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A training job that needs no data on disk: build the model, draw a batch, compute the loss."""

    name: str
    """How reports name it."""
    model: Callable[[], nn.Module]
    """Builds a fresh model; called after seeding, so every rank builds the same weights."""
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss(outputs, targets)``, a scalar mean over the batch."""
    make_batch: MakeBatch
    """Draws ``samples`` inputs and targets from the generator it is given (seeded per rank)."""
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = sgd
    """Builds the optimizer over the model's parameters."""
    description: str = ""
    """One line for reports: the model's shape and the data."""
    tp_plan: Mapping[str, str] | None = None
    """Its tensor-parallel plan (module-name patterns → styles) when the model has no built-in one; None: the
    built-in plan (GPT-2, Llama, our GPT), or none."""

    def __post_init__(self) -> None:
        for field in ("model", "loss", "make_batch", "optimizer"):
            if not callable(getattr(self, field)):
                raise ConfigError(f"workload {self.name!r}: {field} must be callable, got {getattr(self, field)!r}")
