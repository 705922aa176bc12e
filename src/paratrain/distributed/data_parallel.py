"""The data-parallel wrappers, as free functions over a model and a ``DeviceMesh``: DDP (``apply_ddp``), FSDP2's
``replicate`` for tensor-parallel models (``apply_replicate``) and FSDP2's ``fully_shard`` (``apply_fsdp``).

The strategies' presets (:mod:`paratrain.strategies.presets`) and the pipelines' stages both call these, so a
replica or a shard is made one way everywhere.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import ConfigError
from ..model.facts import ModelFacts
from ..model.materialize import is_meta, to_device
from ..model.units import shard_units
from ..options import DDPConfig, FSDPConfig

_DDP_PARAMS = frozenset(inspect.signature(DDP.__init__).parameters)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, device: torch.device | None, config: DDPConfig) -> nn.Module:
    """Wrap ``model`` in DDP over the 1-D ``mesh``, after moving it to ``device`` (None: a module already spread
    over several devices, as model parallelism leaves it).

    A model still on the meta device is being laid out, not trained (``paratrain.dry_run``; ``prepare``
    materializes before DDP): DDP would change nothing it holds and needs real tensors, so it is left unwrapped."""
    from .comm_hooks import register_comm_hook, single_bucket_mb

    if is_meta(model):
        return model
    if device is not None:
        model = to_device(model, device)
    buffers = {}
    if not config.broadcast_buffers:  # newer torch renamed the flag; the default (sync) needs neither
        buffers = {"forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMS else "broadcast_buffers": False}
    bucket_cap_mb = config.bucket_cap_mb
    if config.comm_hook == "powersgd" and mesh.get_group().name() == "gloo":
        bucket_cap_mb = single_bucket_mb(model)  # PowerSGD on gloo breaks with more than one bucket
    ddp = _DDP(
        model,
        device_ids=[device.index] if device is not None and device.type == "cuda" else None,
        # its group, not the mesh: DDP given a slice of a larger mesh (hybrid's dp) turns DTensor parameters into
        # plain ones (its tensor-parallel workaround), undoing expert parallelism's split of the experts
        process_group=mesh.get_group(),
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=config.find_unused_parameters,
        static_graph=config.static_graph,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
        **buffers,
    )
    if config.comm_hook is not None:
        register_comm_hook(ddp, config)
    return ddp


def offload_policy(cpu_offload: bool, device_type: str) -> Any:
    """FSDP2's offload policy: with ``cpu_offload`` the shards live in host memory, pinned where the compute device
    is CUDA (fast, asynchronous copies; pinning needs CUDA, so a CPU job offloads unpinned)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    return CPUOffloadPolicy(pin_memory=device_type == "cuda") if cpu_offload else OffloadPolicy()


def ignored_parameters(model: nn.Module) -> set[nn.Parameter]:
    """The parameters data parallelism leaves to another part (the split experts, whose gradients expert parallelism
    completes itself): those ``DistributedDataParallel`` is told to ignore (``model``'s
    ``_ddp_params_and_buffers_to_ignore``, set by
    ``DistributedDataParallel._set_params_and_buffers_to_ignore_for_model``), the one list DDP, FSDP2's ``replicate``
    and ``fully_shard`` all leave alone here."""
    names = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    return {p for n, p in model.named_parameters() if n in names}


def apply_replicate(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """DDP's algorithm for a model whose parameters are DTensors (tensor parallel): a full replica per rank of the
    1-D ``mesh``, gradients all-reduced over it, by FSDP2's ``replicate`` (``DistributedDataParallel`` refuses
    DTensor parameters); the model is changed in place, but the parameters :func:`ignored_parameters` names."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError:  # added in torch 2.9; the package allows older ones
        raise ConfigError(
            f"ddp with tp (or a zero-bubble pipeline schedule) replicates through FSDP2's replicate, which torch "
            f"{torch.__version__} does not have (torch >= 2.9 does); use zero2 or zero3 there, or a newer torch"
        ) from None
    ignored = ignored_parameters(model)
    replicate(model, mesh=mesh, **({"ignored_params": ignored} if ignored else {}))
    return model


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    config: FSDPConfig,
    mp_policy: object | None = None,
    facts: ModelFacts | None = None,
) -> nn.Module:
    """``fully_shard`` every unit of the wrap policy (:func:`paratrain.model.units.shard_units`; ``facts``:
    ``model``'s, when ``prepare`` found them), then the root, over ``mesh`` (1-D: FSDP, 2-D: HSDP).

    Only the root casts its output (the policy's ``output_dtype``): a unit's output stays in the compute dtype, as
    the root's own layers after the last unit (a final norm with 16-bit weights) expect it. The sharding presets
    give a policy without ``output_dtype``: ``Parallel`` casts the root's outputs itself, except where the loss
    takes them in the compute dtype (``forward_backward``). The parameters :func:`ignored_parameters` names are left
    as they are.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    kwargs = {"mesh": mesh, "offload_policy": offload_policy(config.cpu_offload, mesh.device_type)}
    if ignored := ignored_parameters(model):
        kwargs["ignored_params"] = ignored
    for unit in shard_units(model, wrap_classes=config.wrap_classes, min_params=config.min_params, facts=facts):
        fully_shard(
            unit if len(unit) > 1 else unit[0],
            reshard_after_forward=config.reshard_after_forward,
            mp_policy=dataclasses.replace(policy, output_dtype=None),
            **kwargs,
        )
    fully_shard(model, reshard_after_forward=config.reshard_after_forward, mp_policy=policy, **kwargs)
    return model


@contextmanager
def no_gradient_sync(model: nn.Module) -> Iterator[None]:
    """Backward without communication on a model FSDP2 wrapped (``fully_shard`` or ``replicate``)."""
    model.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)  # type: ignore[operator]


class _DDP(DDP):
    """DDP whose unused-parameter error names the parameters and the fix instead of indices."""

    def forward(self, *args: object, **kwargs: object) -> object:
        try:
            return super().forward(*args, **kwargs)
        except RuntimeError as err:
            if "Expected to have finished reduction" not in str(err):
                raise
            raise ConfigError(unused_parameters_message(self.module, str(err))) from None


def unused_parameters_message(module: nn.Module, ddp_message: str) -> str:
    """One line naming the parameters DDP says got no gradient, with the two fixes."""
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", ddp_message)
    unused = [names[int(i)] for i in found.group(1).split()] if found else []
    which = ", ".join(unused) if unused else "some parameters (set TORCH_DISTRIBUTED_DEBUG=INFO to see which)"
    return (
        f"ddp: these parameters got no gradient in the last step: {which}; pass find_unused_parameters=True "
        "if they are used only sometimes, or freeze them with requires_grad_(False)"
    )
