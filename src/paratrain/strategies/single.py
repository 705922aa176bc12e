"""``single``: one process, one device, no communication."""
from __future__ import annotations

from torch import nn

from ..env import ClusterEnv
from ..errors import ConfigError
from .base import Runtime, Strategy
from .registry import register


@register("single")
class SingleDevice(Strategy):
    """Train on one device in one process."""

    name = "single"

    def mesh_dims(self, env: ClusterEnv) -> None:
        return None

    def validate(self, env: ClusterEnv) -> None:
        if env.world_size > 1:
            raise ConfigError(
                f"strategy 'single' would train {env.world_size} independent copies (WORLD_SIZE={env.world_size}); "
                "use strategy='ddp' or launch one process"
            )

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        return model.to(rt.device)
