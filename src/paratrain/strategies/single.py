"""``single``: one process, one device, no communication."""
from __future__ import annotations

from torch import nn

from ..dims import ParallelDims
from ..env import ClusterEnv
from ..errors import ConfigError
from .base import Runtime, Strategy
from .registry import register


@register("single")
class SingleDevice(Strategy):
    """Train on one device in one process."""

    name = "single"

    def uses_group(self, env: ClusterEnv) -> bool:
        return False

    def dims(self, env: ClusterEnv) -> ParallelDims:
        return ParallelDims()

    def validate(self, env: ClusterEnv) -> None:
        if env.world_size > 1:
            raise ConfigError(
                f"strategy 'single' would train {env.world_size} independent copies (WORLD_SIZE={env.world_size}); "
                "use strategy='ddp' or launch one process"
            )

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        return rt.parallelize(model.to(rt.device))
