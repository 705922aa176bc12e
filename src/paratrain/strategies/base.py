"""What a strategy is: a thin object that wraps a model and optimizer for one way of parallelising.

The real work lives in free functions over a model and a ``DeviceMesh`` (``apply_ddp`` and friends) so hybrid
strategies compose them instead of copying them.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..env import ClusterEnv
from ..precision import Precision


@dataclass(frozen=True)
class Runtime:
    """What a strategy needs to know about the running job."""

    env: ClusterEnv
    device: torch.device
    mesh: DeviceMesh | None
    precision: Precision


class Strategy(ABC):
    """Base class of every registered strategy."""

    name: ClassVar[str]
    native_precision: ClassVar[bool] = False
    """True when the strategy applies mixed precision itself (FSDP's policy) instead of autocast."""

    def mesh_dims(self, env: ClusterEnv) -> dict[str, int] | None:
        """Named parallel degrees this strategy needs, or None when it uses no process group."""
        return {"dp": env.world_size}

    def validate(self, env: ClusterEnv) -> None:
        """Raise a ConfigError when this strategy cannot run in ``env``."""

    @abstractmethod
    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        """Place and wrap ``model``; return the module to train."""

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        """Wrap ``optimizer`` (for sharded optimizers); the default keeps it."""
        return optimizer

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        """Context in which backward accumulates gradients without communicating."""
        return nullcontext()

    def output_device(self, rt: Runtime) -> torch.device:
        """Where the prepared model's outputs land, and so where targets belong."""
        return rt.device

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper ``wrap_model`` added."""
        return model

    def describe(self) -> str:
        return self.name
