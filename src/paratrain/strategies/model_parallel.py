"""``model_parallel``: layer-split model parallelism inside one process.

The model's layers (its top-level children, with ``nn.Sequential``/``nn.ModuleList`` containers opened up) are
cut into contiguous stages; stage i lives on ``cuda:i``, offset by k·n on local rank k when several processes of a
node each own a set of n GPUs (the process's device, bound to its process group and made current, is its first
stage's GPU), and a forward pre-hook moves each layer's inputs to its device, so the model's own ``forward`` and its
``state_dict`` keys are unchanged. Only one stage computes at a time: this buys memory, not speed (use ``pipeline``
for both). On the CPU every stage is the CPU, so the logic is testable anywhere. With several processes the staged
model is wrapped in DDP (data x model parallel).

The root module's own parameters (those not inside a layer) stay on the first stage.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..dims import ParallelDims
from ..distributed.data_parallel import apply_ddp
from ..distributed.model_parallel import apply_model_parallel
from ..env import ClusterEnv
from ..errors import ConfigError
from ..model.cuts import balance, layers
from ..options import DDPConfig, ModelParallelConfig
from .base import Runtime, Strategy
from .registry import register


@register("model_parallel", "mp")
class ModelParallelStrategy(Strategy):
    name = "model_parallel"

    def __init__(self, config: ModelParallelConfig | None = None, **options: object) -> None:
        self.config = config if config is not None else ModelParallelConfig(**options)  # type: ignore[arg-type]
        self.devices: list[torch.device] = []

    def uses_group(self, env: ClusterEnv) -> bool:
        return env.world_size > 1  # one process cuts its model over its devices without a group

    def dims(self, env: ClusterEnv) -> ParallelDims:
        """Replicas over the processes; the stages it cuts are ``mp`` when given (``stages``/``split``), else decided
        from the devices at ``prepare``."""
        mp = self.config.stages or (len(self.config.split) + 1 if self.config.split is not None else 1)
        return ParallelDims(dp_replicate=env.world_size, mp=mp)

    def gpus_per_process(self, env: ClusterEnv) -> int:
        """The GPUs each process of the node owns: the stages asked for, else the node's visible GPUs shared out."""
        if self.config.split is not None:
            return len(self.config.split) + 1
        return self.config.stages or max(torch.cuda.device_count() // env.local_world_size, 1)

    def first_gpu(self, env: ClusterEnv) -> int:
        """The index of this process's first GPU: local rank k owns ``gpus_per_process`` GPUs from k times that.
        Refused in one line unless every process of the node has its own."""
        n, count = self.gpus_per_process(env), torch.cuda.device_count()
        if env.local_world_size * n > count:
            raise ConfigError(
                f"model_parallel with {n} stages per process on {env.local_world_size} process(es) per node needs "
                f"{env.local_world_size * n} GPUs, {count} visible; use fewer stages or processes per node"
            )
        return env.local_rank * n

    def process_device(self, env: ClusterEnv, device: torch.device) -> torch.device:
        """The first stage's GPU: its NCCL communicator, DDP and the current device sit where its first parameters
        are, and no other process's stage shares it."""
        return torch.device("cuda", self.first_gpu(env)) if device.type == "cuda" else device

    def stage_devices(self, rt: Runtime, n: int) -> list[torch.device]:
        if rt.device.type != "cuda":
            return [rt.device] * n
        first = self.first_gpu(rt.env)
        return [torch.device("cuda", first + i) for i in range(n)]

    def output_device(self, rt: Runtime) -> torch.device:
        return self.devices[-1] if self.devices else rt.device

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        named = layers(model, rt.facts)
        if not named:
            raise ConfigError("model_parallel needs a model made of layers (sub-modules); this one has none")
        if self.config.split is not None:
            split = list(self.config.split)
        else:
            n_stages = min(
                self.gpus_per_process(rt.env) if rt.device.type == "cuda" else self.config.stages or 2, len(named)
            )
            split = balance([sum(p.numel() for p in m.parameters()) for _, m in named], n_stages)
        self.devices = devices = self.stage_devices(rt, len(split) + 1)
        mesh = rt.mesh

        def place(m: nn.Module) -> nn.Module:  # the stages over this process's devices, replicated over the others
            staged = apply_model_parallel(m, devices, split, rt.facts)
            return staged if mesh is None else apply_ddp(staged, mesh, None, DDPConfig())

        return rt.parallelize(model, data=place)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return model.no_sync() if isinstance(model, DDP) else nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model
