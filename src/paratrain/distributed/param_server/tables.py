"""A worker's stand-in for a table the servers hold: its forward pulls the rows the batch touches (each once) into
a small leaf tensor and looks them up there; after backward that tensor's gradient is what the step pushes. The
worker never holds more of the table than its batches touch."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .client import Client
from .holdings import Table


class RemoteTable(nn.Module):
    """Replaces an ``nn.Embedding`` or ``nn.EmbeddingBag`` on a worker; same call signature."""

    def __init__(self, original: nn.Module, table: Table, client: Client) -> None:
        super().__init__()
        self.table, self.client = table, client
        self.bag = isinstance(original, nn.EmbeddingBag)
        self.padding_idx = original.padding_idx
        self.mode = getattr(original, "mode", None)
        self.include_last_offset = getattr(original, "include_last_offset", False)
        self.trained = original.weight.requires_grad
        self.pulled: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None, per_sample_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        if input.numel() and (int(input.min()) < 0 or int(input.max()) >= self.table.rows):
            raise IndexError(f"index out of range in table {self.table.name!r} of {self.table.rows} rows")
        ids, inverse = torch.unique(input, sorted=True, return_inverse=True)
        ids = ids.cpu()  # messages are host tensors; the rows go to the batch's device
        rows = self.client.pull_rows(self.table.index, ids).to(input.device)
        if torch.is_grad_enabled() and self.training and self.trained:
            rows.requires_grad_(True)
            self.pulled.append((ids, rows))
        pad = None
        if self.padding_idx is not None:
            hit = (ids == self.padding_idx).nonzero().flatten()
            pad = int(hit[0]) if hit.numel() else None
        if self.bag:
            return F.embedding_bag(
                inverse,
                rows,
                offsets,
                mode=self.mode,
                per_sample_weights=per_sample_weights,
                include_last_offset=self.include_last_offset,
                padding_idx=pad,
            )
        return F.embedding(inverse, rows, padding_idx=pad)

    def take_gradients(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, gradient rows) of every forward since the last step (repeated ids are summed by the server)."""
        ids = [i for i, r in self.pulled if r.grad is not None]
        grads = [r.grad.cpu() for _, r in self.pulled if r.grad is not None]
        self.pulled.clear()
        if not ids:
            return torch.empty(0, dtype=torch.int64), torch.empty(0, self.table.dim)
        return torch.cat(ids), torch.cat(grads)

    def extra_repr(self) -> str:
        return f"{self.table.name!r}, {self.table.rows}x{self.table.dim}, rows on the parameter servers"


def replace_tables(model: nn.Module, tables: tuple[Table, ...], client: Client) -> list[RemoteTable]:
    """Swap each table module of ``model`` for its stand-in (the weight leaves the worker's model)."""
    out = []
    for t in tables:
        parent_name, _, attr = t.name.rpartition(".")
        parent = model.get_submodule(parent_name)
        remote = RemoteTable(getattr(parent, attr), t, client)
        setattr(parent, attr, remote)
        out.append(remote)
    return out


def split_by_server(
    table: Table, ids: torch.Tensor, grads: torch.Tensor, servers: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each server's part of a table's (ids, grads)."""
    owner = table.owner(ids)
    return [(ids[owner == s], grads[owner == s]) for s in range(servers)]
