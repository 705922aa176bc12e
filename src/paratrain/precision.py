"""Numeric precision of training: how the loss is back-propagated and the optimizer stepped.

Kept apart from strategies so every strategy gets every precision without a branch of its own.
"""
from __future__ import annotations

import torch

from .errors import ConfigError


class Precision:
    """Full fp32 training: plain backward and step."""

    name = "fp32"

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


_PRECISIONS: dict[str, type[Precision]] = {"fp32": Precision, "32": Precision}


def create_precision(name: str) -> Precision:
    """The precision plugin called ``name``."""
    try:
        return _PRECISIONS[name]()
    except KeyError:
        raise ConfigError(f"unknown precision {name!r}; choose one of: {', '.join(sorted(_PRECISIONS))}") from None
