"""Module-level functions that checkpoint tests run on several processes through ``paratrain.launch``."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import paratrain

SAMPLES = 96  # 12 optimizer steps per epoch at a global batch of 8


def dropout_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Dropout(0.1), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    return TensorDataset(torch.randn(SAMPLES, 8, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g))


def train(
    strategy: str,
    steps: int,
    ckpt: str,
    *,
    save_at: int | None = None,
    load: bool = False,
    global_batch: int = 8,
    options: dict | None = None,
    async_save: bool = False,
    checkpoint: paratrain.CheckpointConfig | None = None,
    signal_at: dict[int, tuple[int, signal.Signals]] | None = None,
) -> dict[str, object]:
    """Train ``steps`` optimizer steps of a dropout MLP with Adam, a scheduler, shuffled data and random noise
    from torch, NumPy and Python; save at step ``save_at`` (``async_save``: in the background) and/or start by
    loading ``ckpt``. ``checkpoint``: the job's checkpoint configuration; ``signal_at``: rank -> (step, signal) it
    sends itself after that step (the run then ends where the ranks save on it).

    Returns the full parameters, the optimizer's full state and what the run did, from every rank
    (``published_on_return``: whether the save's folder was there when ``save`` returned; ``preempted``: the step
    and folder name the ranks stopped at).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )

    par = paratrain.Parallel(strategy, seed=0, **{"checkpoint": checkpoint, **(options or {})})
    model = dropout_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    loader = DataLoader(dataset(), batch_size=global_batch // par.data_parallel_size, shuffle=True)
    model, optimizer, loader = par.prepare(model, optimizer, loader)
    scheduler = par.prepare(torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.7))
    resumed_at, published_on_return, preempted = None, None, None
    if load:
        par.load(ckpt)
        resumed_at = (par.optimizer_steps, par.epoch)
    elif checkpoint is not None and checkpoint.resume:
        par.resume()  # what epochs() does first
        resumed_at = (par.optimizer_steps, par.epoch)
    batches: list[int] = []
    signal_step, sig = (signal_at or {}).get(par.rank, (None, None))
    try:
        for _ in par.epochs(100 if par.optimizer_steps < steps else 0):
            for x, y in loader:
                x = x + 0.01 * torch.randn_like(x) + 0.01 * float(np.random.rand()) + 0.01 * random.random()
                with par.step(model, optimizer) as step:
                    par.forward_backward(model, x.to(par.device), y.to(par.device), nn.functional.cross_entropy)
                batches.append(int(y.sum()))
                if not step.sync:
                    continue
                scheduler.step()
                if par.optimizer_steps == save_at:
                    published_on_return = par.save(ckpt, async_save=async_save).exists()
                if par.optimizer_steps == signal_step:
                    os.kill(os.getpid(), sig)
                if par.optimizer_steps == steps:
                    break
            if par.optimizer_steps == steps:
                break
    except paratrain.Preempted as stop:
        preempted = (stop.step, stop.folder.name)
    params = par.full_state_dict(model, rank0_only=False)
    full = StateDictOptions(full_state_dict=True, flatten_optimizer_state_dict=True)
    optim_state = (
        {
            k: v
            for k, v in get_optimizer_state_dict(par.unwrap(model), optimizer, options=full).items()
            if k.startswith("state.")
        }
        if strategy != "zero1"
        else {}
    )
    out = {
        "params": params,
        "optim": optim_state,
        "lr": optimizer.param_groups[0]["lr"],
        "resumed_at": resumed_at,
        "batches": batches,
        "step": par.optimizer_steps,
        "published_on_return": published_on_return,
        "preempted": preempted,
    }
    par.close()
    return out


def save_untrained(strategy: str, ckpt: str) -> dict[str, torch.Tensor]:
    """Prepare a model, take a few steps and save; return the full parameters that were saved."""
    return train(strategy, 3, ckpt, save_at=3)["params"]  # type: ignore[return-value]


def load_only(strategy: str, ckpt: str) -> dict[str, object]:
    """Prepare the same model and load ``ckpt``; return its full parameters and the optimizer's full state."""
    return train(strategy, 0, ckpt, load=True)
