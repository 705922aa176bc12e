"""``dp``: ``nn.DataParallel`` — one process drives every local GPU, splitting each batch across them.

Kept for users who have it today. DDP is faster even on one machine (no per-step model replication, no
single-process GIL bottleneck); on CPU or one GPU DataParallel just calls the module, so ``dp`` says so.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..dims import ParallelDims
from ..env import ClusterEnv
from ..errors import ConfigError
from .base import Runtime, Strategy
from .registry import register


@register("dp")
class DataParallelStrategy(Strategy):
    name = "dp"

    def uses_group(self, env: ClusterEnv) -> bool:
        return False

    def dims(self, env: ClusterEnv) -> ParallelDims:
        return ParallelDims()

    def validate(self, env: ClusterEnv) -> None:
        if env.world_size > 1:
            raise ConfigError(
                f"strategy 'dp' (nn.DataParallel) runs in one process but {env.world_size} were launched; "
                "use strategy 'ddp' with several processes, or launch one process (-n 1) for dp"
            )

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        gpus = torch.cuda.device_count() if rt.device.type == "cuda" else 0
        model = rt.parallelize(model, data=lambda m: m.to(rt.device))
        if gpus < 2:
            warnings.warn(
                f"strategy 'dp' on {'one GPU' if gpus == 1 else 'the CPU'} runs as a single device; "
                "'ddp' with one process per device is the faster way to use several",
                stacklevel=4,
            )
            return model
        return nn.DataParallel(model, device_ids=list(range(gpus)), output_device=rt.device.index)

    def head_loss_refusal(self) -> str:
        return "nn.DataParallel runs copies of the model in threads; use ddp"

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, nn.DataParallel) else model
