"""What realises a preset's data-parallel dimension: nothing (one replica), DDP, DDP with a sharded optimizer
(ZeRO-1), or FSDP2's sharding (ZeRO-2/3, HSDP).

An engine says how the model is wrapped over the data mesh, what its wrapper does to the optimizer, how backward
skips communication inside an accumulation window, and how its optimizer state is checkpointed. The composed
strategy (:mod:`paratrain.strategies.composed`) puts one engine after tensor parallelism, and the pipelines
(:mod:`paratrain.strategies.pipeline`) the same engine on each of their stages; the wrappers themselves are
:mod:`paratrain.distributed.data_parallel`'s free functions.
"""

from __future__ import annotations

import dataclasses
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from ..distributed.data_parallel import apply_ddp, apply_fsdp, apply_replicate, no_gradient_sync, offload_policy
from ..distributed.optimizer import param_groups_for
from ..distributed.parallelize import Step, takes_meta
from ..errors import ConfigError
from ..model.materialize import to_device
from ..options import DDPConfig, FSDPConfig
from .base import Runtime

Units = tuple[type[nn.Module], ...]


def all_reduce_traffic(model: nn.Module, ranks: int) -> int:
    """Bytes one rank sends plus receives per step when ``model``'s gradients are all-reduced over ``ranks`` ranks by
    the ring algorithm (gloo's and NCCL's usual one): 2(N-1)/N of the gradient's bytes each way, 0 on one rank.
    The payload a rank hands the all-reduce (its gradient, then the sum back) is 2x the gradient's bytes; the ring
    moves 4(N-1)/N x, the same at N=2 and a third more at N=3. Message headers are not counted."""
    grad = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    return round(2 * 2 * (ranks - 1) / ranks * grad)


class OneReplica:
    """No data parallelism: the model on this rank's device (``single``, and ``tp``'s one group)."""

    zero = 0
    """The ZeRO stage the engine shards at (0: nothing sharded)."""
    swaps_parameters = False
    """True when the wrapper makes new parameter objects, so the optimizer is rebuilt over them."""
    host_tensors = False
    """True when the wrapper keeps tensors it reduces in host memory (CPU offload): see
    :attr:`~paratrain.strategies.base.Strategy.host_tensors`."""

    def __init__(self, options: dict[str, Any], split: bool, config: object | None = None) -> None:
        if options or config is not None:
            raise TypeError(f"unexpected option(s) {sorted(options) or [type(config).__name__]}")

    def step(self, rt: Runtime, mesh: DeviceMesh | None, stage_units: Units | None = None) -> Step:
        """Place (and wrap) the model over ``mesh``, the data-parallel part of the job's mesh. ``stage_units``: the
        module is one pipeline stage, these the classes of its sharding units (empty: those found in it); None: the
        whole model."""
        return lambda m: to_device(m, rt.device)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, inner: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        return optimizer

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model

    def optimizer_state(self, inner: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        from ..checkpoint.states import optimizer_state

        return optimizer_state(inner, optimizer)

    def load_optimizer_state(self, inner: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        from ..checkpoint.states import load_optimizer_state

        load_optimizer_state(inner, optimizer, state)

    def detail(self) -> str | None:
        """The engine's options worth naming in the strategy's description (None: none)."""
        return None

    def expert_shard_options(self, rt: Runtime) -> dict[str, Any]:
        """``fully_shard``'s options for experts sharded on their own (expert parallelism); empty where the engine
        does not shard."""
        return {}

    def traffic_bytes(self, model: nn.Module, steps: int) -> int | None:
        """Bytes a rank moved for ``steps`` optimizer steps of the wrapped ``model``; None: not counted."""
        return None


class Replicas(OneReplica):
    """A full replica per rank, gradients all-reduced: DDP, or FSDP2's ``replicate`` when tensor parallelism made
    the parameters DTensors (``DistributedDataParallel`` refuses those)."""

    def __init__(self, options: dict[str, Any], split: bool, config: DDPConfig | None = None) -> None:
        self.config = config if config is not None else DDPConfig(**options)
        self.split = split
        if split and self.config != DDPConfig():
            raise ConfigError(
                "ddp with tp replicates through FSDP2's replicate, which takes none of "
                "DistributedDataParallel's options; drop them (bucket_cap_mb, comm_hook, …) or drop tp"
            )
        self.swaps_parameters = split
        self._synced_once = False

    def step(self, rt: Runtime, mesh: DeviceMesh | None, stage_units: Units | None = None) -> Step:
        assert mesh is not None, "data parallelism needs a mesh"
        if self.split:
            return lambda m: apply_replicate(m, mesh)
        if stage_units is not None:
            return lambda m: _stage_replica(apply_ddp(m, mesh, rt.device, self.config))
        return lambda m: apply_ddp(m, mesh, rt.device, self.config)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        if self.split:
            return no_gradient_sync(model)
        # static_graph + no_sync before the first synchronised step trips a reducer assert
        # (pytorch#143580). Syncing that one micro-step early gives the same summed gradient.
        if self.config.static_graph and not self._synced_once:
            self._synced_once = True
            return nullcontext()
        self._synced_once = True
        return _ddp(model).no_sync()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model.module if isinstance(model, DDP) else model

    def detail(self) -> str | None:
        return None if self.split else f"bucket_cap_mb={self.config.bucket_cap_mb:g}"

    def traffic_bytes(self, model: nn.Module, steps: int) -> int | None:
        """DDP's gradient all-reduce, computed (not measured): see :func:`all_reduce_traffic`. Not counted for FSDP2's
        ``replicate`` or under a compressing comm hook."""
        if not isinstance(model, DDP) or self.config.comm_hook is not None:
            return None
        return steps * all_reduce_traffic(model.module, dist.get_world_size(model.process_group))


class ShardedOptimizer(Replicas):
    """ZeRO-1: DDP for the gradients, the optimizer state sharded by ``ZeroRedundancyOptimizer`` (whole parameters
    per rank, so the split can be uneven)."""

    zero = 1

    def traffic_bytes(self, model: nn.Module, steps: int) -> int | None:
        return None  # the all-reduce, and the broadcast of every rank's updated parameters besides: not counted

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, inner: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        names = {id(p): n for n, p in inner.named_parameters()}
        groups = param_groups_for(optimizer, names, inner)
        from ..distributed.zero import zero_redundancy  # imports FSDP and DTensor: 1-2 s, when used

        mesh = rt.mesh
        if mesh is not None and mesh.ndim > 1:  # beside tp: the states are sharded over the data-parallel ranks
            mesh = mesh["dp"]
        return zero_redundancy(groups, optimizer, mesh.get_group() if mesh is not None else None)

    def optimizer_state(self, inner: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return zero_optimizer_state(inner, optimizer)

    def load_optimizer_state(self, inner: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
        load_zero_optimizer_state(inner, optimizer, state)

    def detail(self) -> str | None:
        return "ddp + ZeroRedundancyOptimizer"


class Shards(OneReplica):
    """FSDP2's ``fully_shard``: parameters, gradients and optimizer state sharded over the data mesh (1-D, or
    HSDP's replicate x shard). Each block of the wrap policy is one communication unit: its parameters are gathered
    before its forward and its gradients reduce-scattered after its backward; re-sharded after the forward (ZeRO-3)
    or kept gathered until the backward (ZeRO-2)."""

    swaps_parameters = True

    def __init__(self, options: dict[str, Any], split: bool, config: FSDPConfig | None = None) -> None:
        self.config = config if config is not None else FSDPConfig(**options)

    @property
    def zero(self) -> int:  # type: ignore[override]
        return 3 if self.config.reshard_after_forward else 2

    @property
    def host_tensors(self) -> bool:  # type: ignore[override]
        """Offloaded shards stay on the host: the clipping norm and full state dicts reduce them there."""
        return self.config.cpu_offload

    def step(self, rt: Runtime, mesh: DeviceMesh | None, stage_units: Units | None = None) -> Step:
        """A pipeline stage is sharded by its own units, its ties found in it (``rt.facts`` are the whole model's), and
        hands its outputs on in fp32 as the other engines' stages do; the whole model's outputs ``Parallel`` casts."""
        assert mesh is not None, "sharding needs a mesh"
        stage = stage_units is not None
        policy = rt.precision.fsdp_policy(cast_output=stage)
        config = dataclasses.replace(self.config, wrap_classes=stage_units) if stage else self.config
        facts = None if stage else rt.facts

        def shard(m: nn.Module) -> nn.Module:
            placed = to_device(m, rt.device) if not config.cpu_offload else m
            return apply_fsdp(placed, mesh, config, policy, facts)

        return takes_meta(shard)

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        return no_gradient_sync(model)

    def expert_shard_options(self, rt: Runtime) -> dict[str, Any]:
        return {
            "reshard_after_forward": self.config.reshard_after_forward,
            "mp_policy": rt.precision.fsdp_policy(cast_output=False),
            "offload_policy": offload_policy(self.config.cpu_offload, rt.device.type),
        }

    def detail(self) -> str | None:
        return f"reshard_after_forward={self.config.reshard_after_forward}"


def zero_optimizer_state(inner: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """A ``ZeroRedundancyOptimizer``'s state for a checkpoint: that of the parameters this rank's partition holds (so
    each rank writes its own part), plus every parameter's hyper-parameters.

    ZeroRedundancyOptimizer copies its groups' settings (the LR a scheduler set) into the local optimizer only
    when it steps, so they are copied here first. The settings of every parameter, not only this rank's,
    make the state a complete template for loading: a group with no parameter in this rank's partition still
    gets its LR back.
    """
    from ..checkpoint.states import hyperparameters, optimizer_state

    _copy_settings(optimizer.param_groups, optimizer.optim.param_groups)
    names = {id(p): n for n, p in inner.named_parameters()}
    return {**hyperparameters(optimizer.param_groups, names), **optimizer_state(inner, optimizer.optim)}


def load_zero_optimizer_state(inner: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put a loaded ``zero_optimizer_state`` into a ``ZeroRedundancyOptimizer``."""
    from ..checkpoint.states import load_optimizer_state

    load_optimizer_state(inner, optimizer.optim, state)
    names = {id(p): n for n, p in inner.named_parameters()}
    for group in optimizer.param_groups:
        first = names[id(group["params"][0])]
        group.update({k: state[f"param_groups.{first}.{k}"] for k in group if k != "params"})
    _copy_settings(optimizer.param_groups, optimizer.optim.param_groups)


def _stage_replica(ddp: nn.Module) -> nn.Module:
    """DDP around one pipeline stage, its forward never preparing the reducer.

    The pipeline stage runs every forward under no_sync and prepares DDP's reducer itself before a batch's last
    backward chunk. Its metadata inference, on the first batch, runs one more forward outside no_sync, which left the
    reducer expecting the first chunk's gradients: they were synchronised early (the first step rounded differently
    from later ones, so a resumed run was not bitwise equal) and recorded twice for DDP's bucket rebuild (an internal
    assert on the second step when no forward came between, as in GPipe). A model left on the meta device (a dry run)
    is not wrapped, and has nothing to prepare.
    """
    if isinstance(ddp, DDP):
        ddp.require_backward_grad_sync = False
    return ddp


def _ddp(model: nn.Module) -> DDP:
    if not isinstance(model, DDP):
        raise ConfigError("this model was not prepared by paratrain's ddp strategy; pass the model prepare() returned")
    return model


def _copy_settings(source: list[dict[str, Any]], target: list[dict[str, Any]]) -> None:
    """Copy every group setting but the parameters, group by group (ZeRO keeps the groups' order per rank)."""
    for src, dst in zip(source, target, strict=True):
        dst.update({k: v for k, v in src.items() if k != "params"})
