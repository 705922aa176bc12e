"""``zero1``: ZeRO stage 1 — DDP for gradients, optimizer state sharded across ranks by
``ZeroRedundancyOptimizer`` (whole parameters per rank, so the split can be uneven)."""
from __future__ import annotations

import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from .base import Runtime
from .ddp import DDPStrategy
from .optim import constructor_defaults, param_groups_for
from .registry import register


@register("zero1")
class Zero1Strategy(DDPStrategy):
    """DDP + ZeroRedundancyOptimizer."""

    name = "zero1"

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        inner = self.unwrap(model)
        names = {id(p): n for n, p in inner.named_parameters()}
        groups = param_groups_for(optimizer, names, inner)
        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                       process_group=rt.mesh.get_group() if rt.mesh is not None else None,
                                       **constructor_defaults(optimizer))

    def describe(self) -> str:
        return "zero1(ddp + ZeroRedundancyOptimizer)"
