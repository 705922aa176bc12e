"""``zero1``: ZeRO stage 1 — DDP for gradients, optimizer state sharded across ranks by
``ZeroRedundancyOptimizer`` (whole parameters per rank, so the split can be uneven)."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..dims import ParallelDims
from ..distributed.tensor_parallel.degrees import refuse_tp
from ..env import ClusterEnv
from ..options import DDPConfig
from .base import Runtime
from .ddp import DDPStrategy
from .optim import constructor_defaults, param_groups_for
from .registry import register


@register("zero1")
class Zero1Strategy(DDPStrategy):
    """DDP + ZeroRedundancyOptimizer."""

    name = "zero1"

    def __init__(self, config: DDPConfig | None = None, **options: object) -> None:
        refuse_tp(self.name, options)
        super().__init__(config, **options)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        inner = self.unwrap(model)
        names = {id(p): n for n, p in inner.named_parameters()}
        groups = param_groups_for(optimizer, names, inner)
        from torch.distributed.optim import ZeroRedundancyOptimizer  # imports FSDP and DTensor: 1-2 s, when used

        return ZeroRedundancyOptimizer(groups, optimizer_class=type(optimizer),
                                       process_group=rt.mesh.get_group() if rt.mesh is not None else None,
                                       **constructor_defaults(optimizer))

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The state of the parameters this rank's partition holds (so each rank writes its own part), plus
        every parameter's hyper-parameters.

        ZeroRedundancyOptimizer copies its groups' settings (the LR a scheduler set) into the local optimizer only
        when it steps, so they are copied here first. The settings of every parameter, not only this rank's,
        make the state a complete template for loading: a group with no parameter in this rank's partition still
        gets its LR back.
        """
        from ..checkpoint.states import hyperparameters, optimizer_state

        _copy_settings(optimizer.param_groups, optimizer.optim.param_groups)
        inner = self.unwrap(model)
        state = optimizer_state(inner, optimizer.optim)
        names = {id(p): n for n, p in inner.named_parameters()}
        return {**hyperparameters(optimizer.param_groups, names), **state}

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from ..checkpoint.states import load_optimizer_state

        inner = self.unwrap(model)
        load_optimizer_state(inner, optimizer.optim, state)
        names = {id(p): n for n, p in inner.named_parameters()}
        for group in optimizer.param_groups:
            first = names[id(group["params"][0])]
            group.update({k: state[f"param_groups.{first}.{k}"] for k in group if k != "params"})
        _copy_settings(optimizer.param_groups, optimizer.optim.param_groups)

    def dims(self, env: ClusterEnv) -> ParallelDims:
        return ParallelDims(dp_shard=env.world_size, zero=1)

    def describe(self) -> str:
        return "zero1(ddp + ZeroRedundancyOptimizer)"


def _copy_settings(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Copy every group setting but the parameters, group by group (ZeRO keeps the groups' order per rank)."""
    for src, dst in zip(source, target, strict=True):
        dst.update({k: v for k, v in src.items() if k != "params"})
