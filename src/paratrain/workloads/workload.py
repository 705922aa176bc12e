"""What a workload is: a model builder, a loss and a seeded batch maker (named in :mod:`.registry`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..errors import ConfigError

Batch = tuple[torch.Tensor, Any]
MakeBatch = Callable[[int, torch.Generator], Batch]
"""``make_batch(samples, generator) -> (inputs, targets)``: random data drawn from ``generator``; the targets a tensor,
or keyword targets (``{"labels": y}``) for a model that computes its own loss from them."""


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
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None
    """``loss(outputs, targets)``, a scalar mean over the batch; None: the model computes its own loss, read as
    ``Parallel.forward_backward`` reads it (:mod:`paratrain.batch`): nanoGPT's ``model(x, targets) -> (logits,
    loss)``, or transformers' ``model(x, labels=y).loss`` from targets ``{"labels": y}``."""
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
            if not callable(getattr(self, field)) and not (field == "loss" and self.loss is None):
                raise ConfigError(f"workload {self.name!r}: {field} must be callable, got {getattr(self, field)!r}")

    def batch(self, samples: int, generator: torch.Generator, device: torch.device) -> Batch:
        """``make_batch``'s inputs and targets (a tensor or keyword targets), moved to ``device``."""
        return tree_map(
            lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, self.make_batch(samples, generator)
        )
