"""A worker's optimizer: it holds no state and computes nothing; its ``step`` pushes the step's gradients to the
servers and takes the parameters they send back (the servers' optimizers stepped them).

Clipping (``max_norm``) happens where the step's gradient is whole: synchronous servers clip the mean of every
worker's gradient (the push carries the max norm); an asynchronous push is applied alone, so the worker clips its
own gradient, dense and rows, before pushing it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from .client import Client
from .clipping import clip_coefficient, squared_norm
from .tables import RemoteTable, split_by_server


class PushingOptimizer(torch.optim.Optimizer):
    """Stands where the user's optimizer stood; same param groups over the worker's dense parameters."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        dense: set[int],
        client: Client,
        tables: list[RemoteTable],
        synchronous: bool,
    ) -> None:
        groups = [
            {**{k: v for k, v in g.items() if k != "params"}, "params": [p for p in g["params"] if id(p) in dense]}
            for g in optimizer.param_groups
        ]
        super().__init__(groups, dict(optimizer.defaults))
        self.client, self.tables, self.synchronous = client, tables, synchronous
        self.trains = type(optimizer).__name__
        """The class the servers step with."""
        self.max_norm = 0.0
        """What each step clips the global gradient norm to (0: no clipping); the loop sets it."""
        self.grad_norm: float | None = None
        """The norm before the last step's clipping (None: not clipped)."""
        self.after_first_push: Callable[[], object] | None = None
        """Called once, when the first push has been answered (an asynchronous worker may leave from then on)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        servers = len(self.client.layout.servers)
        taken = [(remote.table, *remote.take_gradients()) for remote in self.tables]
        if self.max_norm and not self.synchronous:
            self.grad_norm = self._clip_own(taken)
        rows: list[list] = [[] for _ in range(servers)]
        for table, ids, grads in taken:
            for s, (i, g) in enumerate(split_by_server(table, ids, grads, servers)):
                if i.numel():
                    rows[s].append((table.index, i, g))
        self.client.push(rows, [float(g["lr"]) for g in self.param_groups], self.max_norm if self.synchronous else 0.0)
        if self.max_norm and self.synchronous:
            self.grad_norm = self.client.grad_norm
        if self.after_first_push is not None:
            hook, self.after_first_push = self.after_first_push, None
            hook()
        return loss

    def _clip_own(self, taken: list) -> float:
        """Clip this worker's gradient (what it pushes: its dense parameters' and the rows') to ``max_norm``;
        returns the norm before."""
        dense = [p.grad for params in self.client.params for p in params if p.grad is not None]
        norm = math.sqrt(squared_norm(dense, [(t.index, i, g) for t, i, g in taken]))
        coef = clip_coefficient(norm, self.max_norm)
        for g in dense + [g for _, _, g in taken]:
            g.mul_(coef)
        return norm

    def __repr__(self) -> str:
        return f"PushingOptimizer({self.trains} on {len(self.client.layout.servers)} parameter server(s))"
