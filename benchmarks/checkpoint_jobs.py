"""The job ``checkpoint.py`` times: save and load of a large MLP with Adam state, every way paratrain offers.

Worker functions are module-level so that ``paratrain.launch`` can pickle them for spawned processes.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import torch
from torch import nn

import paratrain


def build_mlp(width: int, layers: int) -> nn.Sequential:
    """``layers`` square linear layers of ``width`` with ReLUs between: layers x width^2 parameters."""
    blocks: list[nn.Module] = []
    for i in range(layers):
        blocks += [nn.Linear(width, width)] + ([nn.ReLU()] if i < layers - 1 else [])
    return nn.Sequential(*blocks)


def _timed(par: paratrain.Parallel, fn) -> float:
    """Seconds from a barrier before ``fn`` to a barrier after it: the slowest rank's time."""
    par.barrier()
    t0 = time.perf_counter()
    fn()
    par.barrier()
    return time.perf_counter() - t0


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def save_load_worker(strategy: str, width: int, layers: int, root: str, rounds: int) -> dict[str, object]:
    """One Adam step (so the optimizer state exists), then ``rounds`` x (save, load) with ``par.save``/``par.load``,
    and for ddp also the single-file way: rank 0 ``torch.save`` of the full model and optimizer state dicts,
    every rank ``torch.load(weights_only=True)`` and ``load_state_dict``."""
    par = paratrain.Parallel(strategy, seed=0, monitor=False)
    model = build_mlp(width, layers)
    params = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model, optimizer = par.prepare(model, optimizer)
    with par.step(model, optimizer):
        par.backward(model(torch.randn(2, width)).pow(2).mean())
    out: dict[str, object] = {"parameters": params}
    rows: dict[str, list] = {"save_s": [], "load_s": [], "bytes": []}
    for r in range(rounds):
        folder = Path(root) / f"{strategy}-{r}"  # a fresh folder: no earlier checkpoint to replace or prune
        rows["save_s"].append(_timed(par, lambda folder=folder: par.save(folder)))
        rows["load_s"].append(_timed(par, lambda folder=folder: par.load(folder)))
        par.barrier()
        if par.is_main:
            rows["bytes"].append(_bytes(folder / "step-00000001"))
            shutil.rmtree(folder)
    out["par.save"] = rows
    if strategy == "ddp":
        single = Path(root) / "single.pt"
        inner = par.unwrap(model)
        full: dict[str, list] = {"save_s": [], "load_s": [], "bytes": []}

        def save_single() -> None:
            if par.is_main:  # fsynced, as par.save's files are: both are on disk when the time stops
                with open(single, "wb") as f:
                    torch.save({"model": inner.state_dict(), "optim": optimizer.state_dict()}, f)
                    f.flush()
                    os.fsync(f.fileno())

        def load_single() -> None:
            state = torch.load(single, map_location="cpu", weights_only=True)
            inner.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optim"])

        for _ in range(rounds):
            full["save_s"].append(_timed(par, save_single))
            full["load_s"].append(_timed(par, load_single))
            full["bytes"].append(single.stat().st_size)
        out["single file"] = full
    par.close()
    return out
