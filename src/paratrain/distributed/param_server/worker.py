"""A worker's optimizer: it holds no state and computes nothing; its ``step`` pushes the step's gradients to the
servers and takes the parameters they send back (the servers' optimizers stepped them)."""
from __future__ import annotations

from collections.abc import Callable

import torch

from .client import Client
from .tables import RemoteTable, split_by_server


class PushingOptimizer(torch.optim.Optimizer):
    """Stands where the user's optimizer stood; same param groups over the worker's dense parameters."""

    def __init__(self, optimizer: torch.optim.Optimizer, dense: set[int], client: Client,
                 tables: list[RemoteTable]) -> None:
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [p for p in g["params"] if id(p) in dense]} for g in optimizer.param_groups]
        super().__init__(groups, dict(optimizer.defaults))
        self.client, self.tables = client, tables
        self.trains = type(optimizer).__name__
        """The class the servers step with."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        servers = len(self.client.layout.servers)
        rows: list[list] = [[] for _ in range(servers)]
        for remote in self.tables:
            ids, grads = remote.take_gradients()
            for s, (i, g) in enumerate(split_by_server(remote.table, ids, grads, servers)):
                if i.numel():
                    rows[s].append((remote.table.index, i, g))
        self.client.push(rows, [float(g["lr"]) for g in self.param_groups])
        return loss

    def __repr__(self) -> str:
        return f"PushingOptimizer({self.trains} on {len(self.client.layout.servers)} parameter server(s))"
