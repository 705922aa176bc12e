"""Sharded data parallel on FSDP2 (``fully_shard``): ``zero2``, ``zero3``/``fsdp`` and ``hsdp``.

Parameters, gradients and optimizer state are sharded across the ``shard`` mesh dimension. Each block chosen
by the wrapping policy is one communication unit: its parameters are all-gathered before its forward and its
gradients reduce-scattered after its backward.

* ``zero3`` / ``fsdp``: parameters are re-sharded after each block's forward (least memory, a second
  all-gather in backward).
* ``zero2``: parameters stay gathered from forward to backward (ZeRO-2-like: more memory, less traffic).
* ``hsdp``: a 2-D mesh (replicate x shard): shard within a group of ranks (a node), replicate across groups.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..dims import ParallelDims
from ..distributed.tensor_parallel.degrees import refuse_tp
from ..env import ClusterEnv
from ..errors import ConfigError
from ..model.units import shard_units
from ..options import FSDPConfig, TPConfig
from .base import Runtime, Strategy, tensor_parallel
from .optim import rebuild
from .registry import register


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, config: FSDPConfig, mp_policy: object | None = None) -> nn.Module:
    """``fully_shard`` every unit of the wrap policy (:func:`paratrain.model.units.shard_units`), then the root, over ``mesh`` (1-D: FSDP, 2-D: HSDP).

    Only the root casts its output (the policy's ``output_dtype``): a unit's output stays in the compute dtype, as
    the root's own layers after the last unit (a final norm with 16-bit weights) expect it. The ``zero*``/``hsdp``
    strategies give a policy without ``output_dtype``: ``Parallel`` casts the root's outputs itself, except where
    the loss takes them in the compute dtype (``forward_backward``).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    kwargs = {"mesh": mesh, "offload_policy": CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy()}
    for unit in shard_units(model, wrap_classes=config.wrap_classes, min_params=config.min_params):
        fully_shard(unit if len(unit) > 1 else unit[0], reshard_after_forward=config.reshard_after_forward,
                    mp_policy=dataclasses.replace(policy, output_dtype=None), **kwargs)
    fully_shard(model, reshard_after_forward=config.reshard_after_forward, mp_policy=policy, **kwargs)
    return model


class FSDPStrategy(Strategy):
    """Shared behaviour of zero2, zero3/fsdp and hsdp."""

    name = "fsdp"
    native_precision = True
    reshard_after_forward = True

    def __init__(self, config: FSDPConfig | None = None, **options: object) -> None:
        self.tp = tensor_parallel(TPConfig.pop(options))
        options.setdefault("reshard_after_forward", self.reshard_after_forward)
        self.config = config if config is not None else FSDPConfig(**options)  # type: ignore[arg-type]

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        mesh, tp = rt.mesh, self.tp
        assert mesh is not None, "fsdp needs a mesh"
        policy = dataclasses.replace(rt.precision.fsdp_policy(), output_dtype=None)

        def shard(m: nn.Module) -> nn.Module:  # over dp; split over tp first when composed (torchtitan's order)
            placed = m.to(rt.device) if not self.config.cpu_offload else m
            return apply_fsdp(placed, mesh["dp"] if tp is not None else mesh, self.config, policy)

        split = (lambda m: tp.apply(m, mesh, rt.precision, rt.device)) if tp is not None else None
        return rt.parallelize(model, tp=split, data=shard)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        # fully_shard replaced the parameters with sharded DTensors: the optimizer must hold those
        assert rt.facts is not None
        return rebuild(optimizer, rt.facts.first_names, model)

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def dims(self, env: ClusterEnv) -> ParallelDims:
        tp = self.tp_degree(env)
        return ParallelDims(dp_shard=env.world_size // tp, zero=3 if self.config.reshard_after_forward else 2, tp=tp)

    def describe(self) -> str:
        tp = f", {self.tp.describe()}" if self.tp is not None else ""
        return f"{self.name}(reshard_after_forward={self.config.reshard_after_forward}{tp})"


@register("zero3", "fsdp")
class Zero3Strategy(FSDPStrategy):
    name = "zero3"


@register("zero2")
class Zero2Strategy(FSDPStrategy):
    name = "zero2"
    reshard_after_forward = False


@register("hsdp")
class HSDPStrategy(FSDPStrategy):
    """Shard within groups of ``shard_size`` ranks, replicate across the groups."""

    name = "hsdp"

    def dims(self, env: ClusterEnv) -> ParallelDims:
        if self.tp is not None:
            refuse_tp(self.name, {"tp": self.tp.config.degree})
        world_size, shard = env.world_size, self.config.shard_size
        if world_size < 4:
            raise ConfigError(f"hsdp shards within groups and replicates across them: it needs at least 4 "
                              f"processes, got {world_size}; use zero3 or ddp, or launch more (-n 4)")
        if shard is None:
            shard = env.local_world_size if env.local_world_size < world_size else world_size // 2
        if shard < 1 or world_size % shard or world_size // shard < 1:
            raise ConfigError(
                f"hsdp cannot split {world_size} processes into shard groups of {shard}; "
                "set shard_size to a divisor of the world size"
            )
        if shard == world_size or shard == 1:
            raise ConfigError(
                f"hsdp with shard groups of {shard} out of {world_size} processes is plain "
                f"{'zero3' if shard == world_size else 'ddp'}; use that, or more processes (e.g. -n 4)"
            )
        return ParallelDims(dp_replicate=world_size // shard, dp_shard=shard, zero=3)
