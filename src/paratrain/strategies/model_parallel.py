"""``model_parallel``: layer-split model parallelism inside one process.

The model's layers (its top-level children, with ``nn.Sequential``/``nn.ModuleList`` containers opened up) are
cut into contiguous stages; stage i lives on ``cuda:i`` (offset by the process's local rank times the stage
count when several processes each own a set of GPUs) and a forward pre-hook moves each layer's inputs to its
device, so the model's own ``forward`` and its ``state_dict`` keys are unchanged. Only one stage computes at
a time: this buys memory, not speed (use ``pipeline`` for both). On the CPU every stage is the CPU, so the
logic is testable anywhere. With several processes the staged model is wrapped in DDP (data x model parallel).

The root module's own parameters (those not inside a layer) stay on the first stage.
"""
from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._pytree import tree_map

from ..env import ClusterEnv
from ..errors import ConfigError
from ..model import find_blocks, find_ties
from .base import Runtime, Strategy
from .ddp import DDPConfig, apply_ddp
from .registry import register


@dataclass(kw_only=True)
class ModelParallelConfig:
    """Where the model is cut."""

    split: Sequence[int] | None = None
    """Layer indices where stages 2, 3, … begin (see ``layers()``); None: balance by parameter count."""
    stages: int | None = None
    """Number of stages when balancing (default: the GPUs per process, or 2 on the CPU)."""

    def __post_init__(self) -> None:
        if self.stages is not None and self.stages < 1:
            raise ConfigError(f"stages must be >= 1, got {self.stages}")


def layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers in definition order: top-level children, with containers and the modules on the way to
    the repeated blocks (a transformers model's ``transformer``/``model``) opened up, so each block is a layer."""
    out: list[tuple[str, nn.Module]] = []
    blocks = find_blocks(model)
    path = blocks.container.split(".") if blocks and blocks.container else []
    opened = {".".join(path[:i]) for i in range(1, len(path) + 1)}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            qual = f"{prefix}{name}"
            if isinstance(child, (nn.Sequential, nn.ModuleList)) or qual in opened:
                visit(qual + ".", child)
            else:
                out.append((qual, child))

    visit("", model)
    return out


def balance(sizes: Sequence[int], stages: int) -> list[int]:
    """Cut points (start indices of stages 2…k) of a contiguous split minimising the largest stage."""
    n = len(sizes)
    if stages > n:
        raise ConfigError(f"cannot cut {n} layers into {stages} stages; use at most {n} stages")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[k][i]: smallest possible largest stage when the first i layers form k stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    points, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        points.append(i)
    return sorted(points)


def stage_of_layers(n_layers: int, split: Sequence[int]) -> list[int]:
    """Stage index of every layer given the cut points."""
    points = list(split)
    if points != sorted(set(points)) or any(not 0 < p < n_layers for p in points):
        raise ConfigError(
            f"split {list(split)} does not fit a model with {n_layers} layers: give increasing indices "
            f"between 1 and {n_layers - 1} (see paratrain.strategies.model_parallel.layers(model))"
        )
    return [sum(i >= p for p in points) for i in range(n_layers)]


def apply_model_parallel(model: nn.Module, devices: Sequence[torch.device], split: Sequence[int]) -> nn.Module:
    """Place each layer on its stage's device and move inputs along with forward pre-hooks.

    Layers that share a parameter (a tied embedding and output head) must sit on one device, since one tensor
    lives on one device: they all go to the stage of the last of them, so the model's output still comes from
    the last stage.
    """
    named = layers(model)
    stage = placement(model, split)
    model.to(devices[0])  # root parameters and buffers stay on the first stage
    for (_, layer), s in zip(named, stage):
        device = devices[s]
        layer.to(device)
        layer.register_forward_pre_hook(_mover(device), with_kwargs=True)
    return model


def placement(model: nn.Module, split: Sequence[int]) -> list[int]:
    """Stage of every layer of ``layers(model)`` for the cut points ``split``, tied layers moved together to the
    stage of the last of them (see ``apply_model_parallel``)."""
    named = layers(model)
    stage = stage_of_layers(len(named), split)
    index = {name: i for i, (name, _) in enumerate(named)}
    for owners in find_ties(model).owners():
        tied = [i for i in (_layer_of(o, index) for o in owners) if i is not None]
        for i in tied:
            stage[i] = max(stage[j] for j in tied)
    return stage


def _layer_of(module_name: str, index: dict[str, int]) -> int | None:
    """Index of the layer that is ``module_name`` or holds it."""
    parts = module_name.split(".")
    for k in range(len(parts), 0, -1):
        found = index.get(".".join(parts[:k]))
        if found is not None:
            return found
    return None


def _mover(device: torch.device):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return tree_map(move, args), tree_map(move, kwargs)

    return hook


@register("model_parallel", "mp")
class ModelParallelStrategy(Strategy):
    name = "model_parallel"

    def __init__(self, config: ModelParallelConfig | None = None, **options: object) -> None:
        self.config = config if config is not None else ModelParallelConfig(**options)  # type: ignore[arg-type]
        self.devices: list[torch.device] = []

    def mesh_dims(self, env: ClusterEnv) -> dict[str, int] | None:
        return {"dp": env.world_size} if env.world_size > 1 else None

    def stage_devices(self, rt: Runtime, n: int) -> list[torch.device]:
        if rt.device.type != "cuda":
            return [rt.device] * n
        first = rt.env.local_rank * n
        if first + n > torch.cuda.device_count():
            raise ConfigError(
                f"model_parallel with {n} stages on {rt.env.local_world_size} process(es) needs "
                f"{n * rt.env.local_world_size} GPUs, {torch.cuda.device_count()} visible; use fewer stages or processes"
            )
        return [torch.device("cuda", first + i) for i in range(n)]

    def output_device(self, rt: Runtime) -> torch.device:
        return self.devices[-1] if self.devices else rt.device

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        named = layers(model)
        if not named:
            raise ConfigError("model_parallel needs a model made of layers (sub-modules); this one has none")
        if self.config.split is not None:
            split = list(self.config.split)
        else:
            default = max(torch.cuda.device_count() // rt.env.local_world_size, 1) if rt.device.type == "cuda" else 2
            n_stages = min(self.config.stages or default, len(named))
            split = balance([sum(p.numel() for p in m.parameters()) for _, m in named], n_stages)
        self.devices = self.stage_devices(rt, len(split) + 1)
        model = apply_model_parallel(model, self.devices, split)
        if rt.mesh is None:
            return model
        return apply_ddp(model, rt.mesh, None, DDPConfig())

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return model.no_sync() if isinstance(model, DDP) else nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model
