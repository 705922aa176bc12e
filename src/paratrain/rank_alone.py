"""Work one rank does alone, where the strategy needs every rank for it: a forward of a model whose layers are
sharded or split (evaluation or logging under ``if rank == 0:``), and a ``state_dict()`` that holds one rank's
shards only (a checkpoint written by rank 0).

A forward under zero3 gathers each layer's parameters from every rank: run by one rank alone it waits for peers
that are busy training, and gloo ends it with a size mismatch, far from the cause. So before such work, outside
any paratrain call, the ranks meet (:meth:`paratrain.call_watch.CallWatch.meet`): when every rank does it, they go
on together (a store round trip, well under a millisecond here); when one does it alone, it stops within a second
or two, once a peer has gone on to another call, in one line naming both ranks, the user's lines and what to do
instead. Strategies where every rank holds the whole model (ddp, zero1's parameters) are left alone.
"""

from __future__ import annotations

import torch
from torch import nn

from .call_watch import CallWatch
from .strategies.base import Strategy


def guard_model(model: nn.Module, strategy: Strategy, calls: CallWatch) -> None:
    """Make ``model``'s forwards outside ``par.step`` and its ``state_dict()`` meet the other ranks first, where
    ``strategy`` needs every rank for them."""
    reason = strategy.every_rank_reason()
    if reason is None or not calls.enabled:
        return
    forward = (
        f"{reason}, so a forward needs every rank: evaluate (or log) on every rank and print on rank 0 (par.print)"
    )
    state = (
        f"{reason}, so one rank's state_dict() is no checkpoint: save with par.save(path), or take the whole "
        "model with par.full_state_dict(model), on every rank"
    )
    uneven = (
        f"{reason}, so every forward needs every rank: give every rank the same number of evaluation batches, or "
        "run them through par.map_evenly(fn, batches)"
    )
    model.register_forward_pre_hook(lambda *_: calls.meet("the model's forward", forward, uneven), prepend=True)
    model.register_state_dict_pre_hook(lambda *_: calls.meet("model.state_dict()", state))


def guard_optimizer(optimizer: torch.optim.Optimizer, strategy: Strategy, calls: CallWatch) -> None:
    """Make ``optimizer.state_dict()`` outside a paratrain call meet the other ranks first, where ``strategy``
    splits the optimizer's state over ranks."""
    reason = strategy.optimizer_every_rank_reason()
    if reason is None or not calls.enabled:
        return
    why = f"{reason}, so one rank's optimizer.state_dict() is no checkpoint: save with par.save(path) on every rank"
    optimizer.register_state_dict_pre_hook(lambda *_: calls.meet("optimizer.state_dict()", why))
