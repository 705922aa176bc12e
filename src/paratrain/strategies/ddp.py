"""``ddp``: DistributedDataParallel — a full replica per process, gradients all-reduced in buckets."""
from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel as DDP

from ..errors import ConfigError
from ..options import DDPConfig, TPConfig
from .base import Runtime, Strategy, tensor_parallel
from .optim import rebuild
from .registry import register

_DDP_PARAMS = frozenset(inspect.signature(DDP.__init__).parameters)


def apply_ddp(model: nn.Module, mesh: DeviceMesh, device: torch.device | None, config: DDPConfig) -> DDP:
    """Wrap ``model`` in DDP over the 1-D ``mesh``, after moving it to ``device`` (None: a module already spread
    over several devices, as model parallelism leaves it)."""
    from .hooks import register_comm_hook, single_bucket_mb

    if device is not None:
        model = model.to(device)
    buffers = {}
    if not config.broadcast_buffers:  # newer torch renamed the flag; the default (sync) needs neither
        buffers = {"forward_sync_buffers" if "forward_sync_buffers" in _DDP_PARAMS else "broadcast_buffers": False}
    bucket_cap_mb = config.bucket_cap_mb
    if config.comm_hook == "powersgd" and mesh.get_group().name() == "gloo":
        bucket_cap_mb = single_bucket_mb(model)  # PowerSGD on gloo breaks with more than one bucket
    ddp = _DDP(
        model,
        device_ids=[device.index] if device is not None and device.type == "cuda" else None,
        device_mesh=mesh,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=config.find_unused_parameters,
        static_graph=config.static_graph,
        gradient_as_bucket_view=config.gradient_as_bucket_view,
        **buffers,
    )
    if config.comm_hook is not None:
        register_comm_hook(ddp, config)
    return ddp


def apply_replicate(model: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """DDP's algorithm for a model whose parameters are DTensors (tensor parallel): a full replica per rank of the
    1-D ``mesh``, gradients all-reduced over it, by FSDP2's ``replicate`` (``DistributedDataParallel`` refuses
    DTensor parameters); the model is changed in place."""
    try:
        from torch.distributed._composable.replicate_with_fsdp import replicate
    except ImportError:  # added in torch 2.9; the package allows older ones
        raise ConfigError(f"ddp with tp replicates through FSDP2's replicate, which torch {torch.__version__} does "
                          "not have (torch >= 2.9 does); use zero2 or zero3 with tp, or a newer torch") from None
    replicate(model, mesh=mesh)
    return model


@contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
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
    import re

    names = [n for n, p in module.named_parameters() if p.requires_grad]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", ddp_message)
    unused = [names[int(i)] for i in found.group(1).split()] if found else []
    which = ", ".join(unused) if unused else "some parameters (set TORCH_DISTRIBUTED_DEBUG=INFO to see which)"
    return (f"ddp: these parameters got no gradient in the last step: {which}; pass find_unused_parameters=True "
            "if they are used only sometimes, or freeze them with requires_grad_(False)")


@register("ddp")
class DDPStrategy(Strategy):
    """Data parallel with a full replica per process."""

    name = "ddp"

    def __init__(self, config: DDPConfig | None = None, **options: object) -> None:
        self.tp = tensor_parallel(TPConfig.pop(options))
        self.config = config if config is not None else DDPConfig(**options)  # type: ignore[arg-type]
        if self.tp is not None and self.config != DDPConfig():
            raise ConfigError("ddp with tp replicates through FSDP2's replicate, which takes none of "
                              "DistributedDataParallel's options; drop them (bucket_cap_mb, comm_hook, …) or drop tp")
        self._synced_once = False

    def wrap_model(self, model: nn.Module, rt: Runtime) -> nn.Module:
        mesh = rt.mesh
        assert mesh is not None, "ddp needs a mesh"
        if self.tp is not None:  # DistributedDataParallel refuses DTensor parameters; FSDP2's replicate takes them
            tp = self.tp
            return rt.parallelize(model, tp=lambda m: tp.apply(m, mesh, rt.precision, rt.device),
                                  data=lambda m: apply_replicate(m, mesh["dp"]))
        return rt.parallelize(model, data=lambda m: apply_ddp(m, mesh, rt.device, self.config))

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, rt: Runtime) -> torch.optim.Optimizer:
        if self.tp is not None:  # tensor parallel and replicate made new parameter objects
            assert rt.facts is not None
            return rebuild(optimizer, rt.facts.first_names, model)
        return optimizer

    def no_sync(self, model: nn.Module) -> AbstractContextManager:
        if self.tp is not None:
            return _no_gradient_sync(model)
        # static_graph + no_sync before the first synchronised step trips a reducer assert
        # (pytorch#143580). Syncing that one micro-step early gives the same summed gradient.
        if self.config.static_graph and not self._synced_once:
            self._synced_once = True
            return nullcontext()
        self._synced_once = True
        return _ddp(model).no_sync()

    def unwrap(self, model: nn.Module) -> nn.Module:
        return _ddp(model).module if isinstance(model, DDP) else model

    def describe(self) -> str:
        if self.tp is not None:
            return f"ddp({self.tp.describe()})"
        return f"ddp(bucket_cap_mb={self.config.bucket_cap_mb:g})"


def _ddp(model: nn.Module) -> DDP:
    if not isinstance(model, DDP):
        raise ConfigError("this model was not prepared by paratrain's ddp strategy; pass the model prepare() returned")
    return model
