"""What ``par.step`` and ``par.epochs`` do besides counting: what one micro-step is, the optimizer step at the end of
an accumulation window, and each epoch's sample order."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .data import ShardSampler
from .distributed.grad_norm import clip_grad_norm
from .precision import Precision
from .strategies.base import Strategy


@dataclass(frozen=True)
class StepInfo:
    """What one ``Parallel.step`` micro-step is."""

    micro_step: int
    """Index inside the accumulation window, 0 … accumulate-1."""
    sync: bool
    """True on the last micro-step: gradients are communicated and the optimizer steps."""


def finish_step(strategy: Strategy, model: nn.Module, optimizer: torch.optim.Optimizer, precision: Precision,
                max_norm: float | None) -> float | None:
    """End an accumulation window: the strategy completes the gradients (a weight tied across pipeline stages,
    tensor parallelism's partial sums), the global norm over every shard is clipped to ``max_norm`` when given, the
    optimizer steps (through the grad scaler) and the gradients are freed. Returns the norm before clipping (None
    when not clipped)."""
    strategy.sync_gradients(model)
    norm = None
    if max_norm is not None:
        precision.unscale(optimizer)
        norm = clip_grad_norm(model.parameters(), max_norm, group=strategy.grad_norm_group(model),
                              counted=strategy.grad_norm_parameters(model))
    precision.step(optimizer)
    optimizer.zero_grad(set_to_none=True)
    return norm


def start_epoch(loaders: Iterable[object], epoch: int) -> None:
    """Give every prepared loader's sampler the epoch, so each epoch shuffles in another (agreed) order."""
    for loader in loaders:
        sampler = getattr(loader, "sampler", None)
        if isinstance(sampler, ShardSampler):
            sampler.set_epoch(epoch)


def idle_epoch_warning(epoch: int, accumulate: int) -> str:
    """The line for an epoch that took no optimizer step."""
    return (f"paratrain: warning: epoch {epoch} took no optimizer step (accumulate={accumulate}, batches this epoch "
            "fewer than that, or none); check the loader and accumulate")
