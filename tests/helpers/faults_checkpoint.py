"""A small real checkpoint, made in this process, for the fault tests."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

import paratrain


def trained(par: paratrain.Parallel) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = nn.Linear(4, 2)
    model, opt = par.prepare(model, torch.optim.Adam(model.parameters()))
    with par.step(model, opt):
        par.backward(model(torch.randn(3, 4)).sum())
    return model, opt


def small_checkpoint(root: Path) -> Path:
    """Save one step of a tiny model into ``root``; return the step folder."""
    par = paratrain.Parallel("single", monitor=False)
    trained(par)
    folder = par.save(root)
    par.close()
    return folder
