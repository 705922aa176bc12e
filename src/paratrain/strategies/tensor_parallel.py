"""``tp``: tensor parallelism over every rank — each layer's weights split across the processes, which compute
every batch together (see :mod:`paratrain.distributed.tensor_parallel` for the plans). With data parallelism around
it, use ``ddp``, ``zero2`` or ``zero3`` with ``tp=``."""
from __future__ import annotations

import torch
from torch import nn

from ..dims import ParallelDims
from ..env import ClusterEnv
from ..errors import ConfigError
from ..options import TPConfig
from .base import Runtime, Strategy, tensor_parallel
from .optim import rebuild
from .registry import register


@register("tp")
class TPStrategy(Strategy):
    """Every layer split over all ranks; one replica of the model, one batch at a time."""

    name = "tp"

    def __init__(self, tp: int | None = None, tp_plan: dict | None = None) -> None:
        self.tp = tensor_parallel(TPConfig(degree=tp, plan=tp_plan))

    def dims(self, env: ClusterEnv) -> ParallelDims:
        self.validate_degree(env)
        return ParallelDims(tp=env.world_size)

    def validate_degree(self, env: ClusterEnv) -> None:
        degree = self.tp.config.degree  # type: ignore[union-attr]
        if degree is not None and degree != env.world_size:
            raise ConfigError(f"strategy 'tp' splits each layer over all {env.world_size} processes, not tp={degree}; "
                              f"for {env.world_size // degree if env.world_size % degree == 0 else 'k'} replicas of "
                              f"tp={degree} use Parallel('ddp', tp={degree}) or Parallel('zero3', tp={degree})")

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        mesh, tp = rt.mesh, self.tp
        assert mesh is not None and tp is not None, "tp needs a mesh"
        return rt.parallelize(model, tp=lambda m: tp.apply(m, mesh, rt.precision, rt.device))

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        # the plan replaced the parameters with DTensors: the optimizer must hold those
        assert rt.facts is not None
        return rebuild(optimizer, rt.facts.first_names, model)

    def describe(self) -> str:
        return self.tp.describe()  # type: ignore[union-attr]
