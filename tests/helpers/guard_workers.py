"""What the numerics guard's launched job runs (``tests/test_guard.py``): small runs of one strategy, some fed a bad
batch on one rank, each compared with the run that never saw that batch's update."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import paratrain
from helpers.dist_workers import build_model

BATCH = 8
"""Samples of one global batch (each data-parallel replica reads its slice)."""


def batches(n: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randn(n, BATCH, 8, generator=g), torch.randn(n, BATCH, 4, generator=g)


def train(
    strategy: str,
    options: dict[str, Any],
    feed: list[int],
    *,
    guard: bool | paratrain.GuardConfig = True,
    nan: tuple[int, ...] = (),
    spike: tuple[int, ...] = (),
    save_after: int | None = None,
    ckpt: str | None = None,
) -> dict[str, Any]:
    """Adam steps on the batches ``feed`` (indices); batches in ``nan`` get a NaN target on rank 1 only, those in
    ``spike`` targets 1000 times larger on rank 1 only (every rank must still skip them); ``save_after``:
    ``par.save()`` after that many steps. Returns the full model state and this rank's optimizer state after each
    step, and what the guard counted and said."""
    par = paratrain.Parallel(strategy, monitor=False, guard=guard, checkpoint=ckpt, **options)
    model = build_model()
    model, opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=0.01))
    replicas, r = par.data_parallel_size, par.data_parallel_rank
    per = BATCH // replicas
    xs, ys = batches()
    states = []
    for i, b in enumerate(feed):
        x, y = xs[b][r * per : (r + 1) * per].clone(), ys[b][r * per : (r + 1) * per].clone()
        if b in nan and par.rank == 1:
            y[0, 0] = float("nan")
        if b in spike and par.rank == 1:
            y = y * 1000
        with par.step(model, opt):
            par.forward_backward(model, x.to(par.device), y.to(par.device), nn.functional.mse_loss)
        if save_after == i + 1:
            par.save()
        states.append(_state(par, model, opt))
    guarded = par._loop.guard
    out = {
        "states": states,
        "skipped": None if guarded is None else guarded.skipped,
        "reloads": None if guarded is None else guarded.reloads,
        "lines": None if guarded is None else guarded.lines,
    }
    par.close()
    return out


def _state(par: paratrain.Parallel, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """The full model state and this rank's optimizer state, as they are now."""
    return {"model": par.full_state_dict(model, rank0_only=False), "optim": _local(opt.state_dict()["state"])}


def _local(state: Any) -> Any:
    """``state`` with DTensors as this rank's local tensors."""
    if isinstance(state, dict):
        return {k: _local(v) for k, v in state.items()}
    return (state.to_local() if hasattr(state, "to_local") else state).clone()


def guard_case(strategy: str, options: dict[str, Any], ckpt: str) -> dict[str, Any]:
    """Every run the test compares, for one layout: a run saved after batch 0 in which batch 2 holds a NaN on rank 1
    and batch 3 spikes there (two skips in a row: the save is reloaded, undoing batch 1), and the run that reads only
    batches 0, 4 and 5, with the guard on and off."""
    bad = paratrain.GuardConfig(spike=4.0, window=2, reload_after=2)
    return {
        "off": train(strategy, options, [0, 4, 5], guard=False),
        "on": train(strategy, options, [0, 4, 5]),
        "bad": train(
            strategy, options, list(range(6)), guard=bad, nan=(2,), spike=(3,), save_after=1, ckpt=f"{ckpt}/{strategy}"
        ),
    }
