"""Learning-rate scaling when data parallelism makes the global batch larger than the one an LR was tuned at."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from .errors import ConfigError

if TYPE_CHECKING:
    import torch

RULES = ("linear", "sqrt")


def scale_lr(base_lr: float, world_size: float, rule: str = "linear") -> float:
    """The LR for a global batch ``world_size`` times the one ``base_lr`` was tuned at (below 1: a smaller batch,
    a smaller LR).

    ``linear`` multiplies by the factor (Goyal et al. 2017, "Accurate, Large Minibatch SGD": keeps SGD's
    update per sample the same; pair it with a warmup). ``sqrt`` multiplies by its square root (Krizhevsky
    2014; Hoffer et al. 2017: keeps the gradient noise the same), the safer choice for Adam-type optimizers.
    ``world_size`` is the number of data-parallel replicas when each keeps the tuned per-device batch, times
    the accumulation steps if any.
    """
    if base_lr <= 0:
        raise ConfigError(f"base LR must be > 0, got {base_lr}")
    if world_size <= 0:
        raise ConfigError(f"world size (batch factor) must be > 0, got {world_size}")
    if rule == "linear":
        return base_lr * world_size
    if rule == "sqrt":
        return base_lr * math.sqrt(world_size)
    raise ConfigError(f"unknown LR scaling rule {rule!r}; choose one of: {', '.join(RULES)}")


def warmup_factor(step: int, warmup_steps: int) -> float:
    """LR multiplier of a linear warmup: (step + 1) / warmup_steps for the first steps, then 1."""
    if warmup_steps < 0:
        raise ConfigError(f"warmup steps must be >= 0, got {warmup_steps}")
    return 1.0 if step >= warmup_steps else (step + 1) / warmup_steps


def linear_warmup(optimizer: torch.optim.Optimizer, warmup_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A scheduler that ramps every group's LR linearly up over ``warmup_steps`` optimizer steps: the usual
    companion of a scaled LR, since a large LR from step one can diverge."""
    import torch

    warmup_factor(0, warmup_steps)  # validates
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: warmup_factor(step, warmup_steps))
