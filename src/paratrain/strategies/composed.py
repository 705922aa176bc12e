"""One strategy class for every preset of :mod:`.presets`: tensor, context and expert parallelism (when the preset
and its options ask for them), then the preset's data-parallel engine, in the order
:func:`~paratrain.distributed.parallelize.parallelize` states. What differs between ``ddp``, ``zero1``, ``zero2``,
``zero3``, ``hsdp``, ``tp`` and ``single`` is data: the preset's row and the options given.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
from torch import nn

from ..composition import refuse_degree
from ..dims import ParallelDims
from ..distributed.context_parallel.part import context_parallel
from ..distributed.optimizer import rebuild
from ..distributed.tensor_parallel.degrees import refuse_tp
from ..env import ClusterEnv
from ..errors import ConfigError
from ..options import CPConfig, DDPConfig, EPConfig, FSDPConfig, TPConfig
from .base import Runtime, Strategy, expert_parallel, tensor_parallel
from .presets import PRESETS, Preset
from .registry import register


class Composed(Strategy):
    """The strategy a :class:`~paratrain.strategies.presets.Preset` describes, with its options."""

    def __init__(self, preset: Preset, config: DDPConfig | FSDPConfig | None = None, **options: object) -> None:
        self.preset = preset
        self.name = preset.name  # type: ignore[misc]
        self.tp = tensor_parallel(_tp_config(preset, options))
        self.cp = context_parallel(_cp_config(preset, options))
        self.ep = expert_parallel(EPConfig.pop(options, preset.name, preset.takes.ep))
        if config is not None and options:
            raise ConfigError(
                f"strategy {preset.name!r} got options {sorted(options)} beside a config object; set them on the config"
            )
        engine_options = {**preset.defaults, **options} if config is None else {}
        self.data = preset.engine(engine_options, split=self.tp.splits, config=config)  # type: ignore[arg-type]

    def uses_group(self, env: ClusterEnv) -> bool:
        return self.preset.groups

    @property
    def host_tensors(self) -> bool:
        return self.data.host_tensors

    def validate(self, env: ClusterEnv) -> None:
        if not self.preset.groups and env.world_size > 1:
            raise ConfigError(
                f"strategy {self.name!r} would train {env.world_size} independent copies "
                f"(WORLD_SIZE={env.world_size}); use strategy='ddp' or launch one process"
            )
        self.dims(env)

    def dims(self, env: ClusterEnv) -> ParallelDims:
        tp = self.tp_degree(env)
        cp = self.cp.degree(self.name, env.world_size // tp)
        if self.preset.hierarchical:
            return _hierarchical(self.name, env, self.data.config.shard_size, cp)  # type: ignore[attr-defined]
        dp, zero, ep = env.world_size // (tp * cp), self.data.zero, self.ep.degree
        return (
            ParallelDims(dp_shard=dp, zero=zero, cp=cp, tp=tp, ep=ep)
            if zero
            else ParallelDims(dp_replicate=dp, cp=cp, tp=tp, ep=ep)
        )

    def tp_degree(self, env: ClusterEnv) -> int:
        if self.preset.takes.tp != "all":
            return super().tp_degree(env)
        degree = self.tp.config.degree  # type: ignore[union-attr]
        if degree is not None and degree != env.world_size:
            replicas = env.world_size // degree if env.world_size % degree == 0 else "k"
            raise ConfigError(
                f"strategy {self.name!r} splits each layer over all {env.world_size} processes, not "
                f"tp={degree}; for {replicas} replicas of tp={degree} use Parallel('ddp', tp={degree}) "
                f"or Parallel('zero3', tp={degree})"
            )
        return env.world_size

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        mesh = rt.mesh
        # data parallelism spans the whole mesh (1-D, or HSDP's replicate x shard), or its dp part beside tp
        data_mesh = mesh["dp"] if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) else mesh
        # the cp ranks' gradients are reduced with the data-parallel ranks' (dp x cp)
        data_mesh = self.cp.gradient_mesh(mesh, data_mesh)
        tp_mesh = mesh["tp"] if mesh is not None and "tp" in (mesh.mesh_dim_names or ()) else None
        return rt.parallelize(
            model,
            tp=self.tp.splitter(rt, self.ep.modules),
            cp=self.cp.step(mesh),
            ep=self.ep.step(data_mesh, rt.device, self.data.zero, self.data.expert_shard_options(rt), tp=tp_mesh),
            data=self.data.step(rt, data_mesh),
        )

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        if self.data.swaps_parameters or self.tp.splits or self.ep.splits:  # it must hold the new parameter objects
            assert rt.facts is not None
            optimizer = rebuild(optimizer, rt.facts.first_names, self.unwrap(model))
        return self.data.wrap_optimizer(optimizer, self.unwrap(model), rt)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return self.data.no_sync(model)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return self.data.unwrap(model)

    def sync_gradients(self, model: nn.Module) -> None:
        super().sync_gradients(model)
        self.ep.sync_gradients(model)

    def every_rank_reason(self) -> str | None:
        if self.ep.splits:
            return "under ep each rank holds part of every mixture-of-experts layer's experts"
        if self.preset.takes.tp == "all":
            return "under tp every layer is split over the ranks"
        if self.data.zero >= 2:
            return f"under {self.name} each rank holds a shard of every layer"
        if self.cp.splits:
            return "under cp the ranks of a cp group exchange every attention's inputs"
        return super().every_rank_reason()

    def optimizer_every_rank_reason(self) -> str | None:
        if self.data.zero == 1:
            return f"under {self.name} each rank holds a shard of the optimizer's state"
        return self.every_rank_reason()

    def traffic_bytes(self, model: nn.Module, steps: int) -> int | None:
        if not self.preset.groups:
            return 0  # one process: nothing to keep in step
        if self.cp.splits or self.ep.splits:
            return None  # the attention exchanges, the tokens' all-to-all and the experts' own reduction: not counted
        return self.tp.traffic_bytes(self.data.traffic_bytes(model, steps))

    def optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return self.data.optimizer_state(self.unwrap(model), optimizer)

    def load_optimizer_state(self, model: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        self.data.load_optimizer_state(self.unwrap(model), optimizer, state)

    def describe(self) -> str:
        if self.preset.takes.tp == "all":
            return self.tp.describe()  # type: ignore[return-value]
        parts = [
            part for part in (self.data.detail(), self.tp.describe(), self.cp.describe(), self.ep.describe()) if part
        ]
        return f"{self.name}({', '.join(parts)})" if parts else self.name


def _tp_config(preset: Preset, options: dict[str, Any]) -> TPConfig | None:
    """The tensor-parallel part of ``options`` (taken out of them) as ``preset`` reads it."""
    if preset.takes.tp == "never":
        refuse_tp(preset.name, options)
        return None
    if preset.takes.tp == "all":
        return TPConfig(degree=options.pop("tp", None), plan=options.pop("tp_plan", None))
    return TPConfig.pop(options)


def _cp_config(preset: Preset, options: dict[str, Any]) -> CPConfig | None:
    """The context-parallel part of ``options`` (taken out of them); one line for a preset it does not compose with."""
    config = CPConfig.pop(options)
    if config is not None and not preset.takes.cp:
        raise ConfigError(refuse_degree(preset.name, "cp", config.degree))
    return config


def _hierarchical(name: str, env: ClusterEnv, shard: int | None, cp: int = 1) -> ParallelDims:
    """Shard groups of ``shard`` ranks (default: a node's processes, or half the world on one node), replicated
    across the groups; a split that is plain zero3 or ddp says so. ``cp``: ranks that split each sequence, beside
    the data-parallel ones."""
    world_size = env.world_size // cp
    if world_size < 4:
        raise ConfigError(
            f"{name} shards within groups and replicates across them: it needs at least 4 "
            f"processes, got {world_size}; use zero3 or ddp, or launch more (-n 4)"
        )
    if shard is None:
        shard = env.local_world_size // cp if env.local_world_size < env.world_size else world_size // 2
    if shard < 1 or world_size % shard:
        raise ConfigError(
            f"{name} cannot split {world_size} processes into shard groups of {shard}; "
            "set shard_size to a divisor of the world size"
        )
    if shard == world_size or shard == 1:
        raise ConfigError(
            f"{name} with shard groups of {shard} out of {world_size} processes is plain "
            f"{'zero3' if shard == world_size else 'ddp'}; use that, or more processes (e.g. -n 4)"
        )
    return ParallelDims(dp_replicate=world_size // shard, dp_shard=shard, zero=3, cp=cp)


def preset(name: str) -> Callable[..., Composed]:
    """The constructor of preset ``name``: ``preset("zero3")(FSDPConfig(wrap_classes=[Block]))``."""
    return partial(Composed, PRESETS[name])


for _preset in PRESETS.values():
    register(_preset.name, *_preset.aliases)(preset(_preset.name))
