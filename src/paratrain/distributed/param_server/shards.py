"""What one server holds: its dense parameters (views of one flat buffer, which is what a pull sends) and its rows
of every table, each with the optimizer that steps it and that optimizer's state beside it."""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
from torch import nn

from .holdings import Holdings, Table
from .optimizers import dense_optimizer, group_of, set_learning_rates, sparse_optimizer, table_kind


@dataclass
class TableShard:
    table: Table
    lo: int
    weight: nn.Parameter
    optimizer: torch.optim.Optimizer | None
    """None: the training optimizer does not hold the table (frozen rows, only read)."""
    group: int
    """The user's param group the table's weight is in (its learning rate comes with each push)."""

    def apply(self, ids: torch.Tensor, grads: torch.Tensor, scale: float) -> None:
        """One optimizer step over the rows ``ids`` (global ids, repeats summed) with ``grads * scale``."""
        if ids.numel() == 0 or self.optimizer is None:
            return
        local = (ids - self.lo).unsqueeze(0)
        self.weight.grad = torch.sparse_coo_tensor(local, grads * scale, self.weight.shape).coalesce()
        self.optimizer.step()
        self.weight.grad = None


class ServerShards:
    """Server ``index``'s part of the model and of its optimizer."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: Holdings,
        index: int,
        table_optimizer: str | None,
    ) -> None:
        names = {id(p): n for n, p in model.named_parameters()}
        settings = group_of(optimizer, names)
        current = dict(model.named_parameters())
        slots = layout.dense[index]
        self.flat = torch.empty(layout.dense_numel(index), dtype=layout.dtype)
        self.grad = torch.zeros_like(self.flat)
        self.params: dict[str, nn.Parameter] = {}
        for slot in slots:
            view = self.flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
            view.copy_(current[slot.name].detach())
            p = nn.Parameter(view)
            p.grad = self.grad[slot.offset : slot.offset + slot.numel].view(slot.shape)
            self.params[slot.name] = p
        self.optimizer, self.groups = dense_optimizer(optimizer, self.params, settings)
        self.group_count = len(optimizer.param_groups)
        self.tables = [self._shard(model, t, index, settings, optimizer, table_optimizer) for t in layout.tables]

    def _shard(
        self,
        model: nn.Module,
        table: Table,
        index: int,
        settings: dict,
        optimizer: torch.optim.Optimizer,
        choice: str | None,
    ) -> TableShard:
        module = model.get_submodule(table.name)
        name = f"{table.name}.weight"
        trained = name in settings
        kind = table_kind(optimizer, table.name, settings[name], choice) if trained else ""
        b = table.bounds[index]
        if module.weight.is_meta:  # built on the meta device: the rows are made here, nowhere else
            g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{b.lo}".encode()))
            rows = torch.randn(b.hi - b.lo, b.dim, generator=g, dtype=module.weight.dtype)
            pad = getattr(module, "padding_idx", None)
            if pad is not None and b.lo <= pad < b.hi:
                rows[pad - b.lo].zero_()
        else:
            rows = module.weight.detach()[b.lo : b.hi].clone()
        weight = nn.Parameter(rows, requires_grad=trained)
        if not trained:
            return TableShard(table, b.lo, weight, None, 0)
        return TableShard(table, b.lo, weight, sparse_optimizer(kind, weight, settings[name]), settings[name]["group"])

    def set_learning_rates(self, lrs: list[float]) -> None:
        """The learning rate of each user param group, as the worker's optimizer (and its schedule) has it."""
        set_learning_rates(self.optimizer, self.groups, lrs)
        for shard in self.tables:
            for group in shard.optimizer.param_groups if shard.optimizer is not None else ():
                group["lr"] = lrs[shard.group]

    def step_dense(self, scale: float) -> None:
        """The optimizer step over the summed dense gradients times ``scale``; the sum restarts at zero."""
        if self.optimizer is not None:
            if scale != 1.0:
                self.grad.mul_(scale)
            self.optimizer.step()
        self.grad.zero_()
