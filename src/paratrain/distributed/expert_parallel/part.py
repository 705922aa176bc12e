"""The part of a strategy that splits experts over ranks (``ep=``), and its absence.

Every composed strategy holds one and calls its hooks unconditionally: :class:`WholeExperts` does nothing at each;
:class:`ExpertParallel` splits each routed-experts module over groups of ``ep`` data-parallel ranks in a step of
its own, which :func:`~paratrain.distributed.parallelize.parallelize` runs just before the data-parallel one (DDP or
FSDP2) so the experts get their own layout first, and completes their gradients where no data engine does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ...errors import ConfigError

Step = Callable[[nn.Module], nn.Module]


class WholeExperts:
    """No expert parallelism: every expert on every rank, as any other parameter."""

    splits = False
    """Parameters become DTensors split over ranks (the optimizer is then rebuilt over them)."""
    degree = 1

    def step(
        self, mesh: Any, device: Any, zero: int, fsdp_kwargs: dict[str, Any], stage: bool = False, tp: Any = None
    ) -> Step | None:
        """:func:`~paratrain.distributed.parallelize.parallelize`'s ``ep``: the step that lays the experts out over
        the 1-D data mesh ``mesh`` before the data engine's step (``zero``: that engine's ZeRO stage;
        ``fsdp_kwargs``: its ``fully_shard`` options, which the experts take too; ``stage``: the module is one
        pipeline stage, which may hold no experts, the whole model having been checked by :meth:`check`; ``tp``:
        the tp mesh beside it, whose ranks, given the same rows, divide them for their experts); None: every
        expert stays whole."""
        return None

    def modules(self, model: nn.Module) -> list[nn.Module]:
        """``model``'s routed-experts modules this part lays out itself, which tensor parallelism leaves whole."""
        return []

    def check(self, model: nn.Module) -> None:
        """One line unless ``model``'s experts can be split (before it is cut into pipeline stages)."""

    def sync_gradients(self, model: nn.Module) -> None:
        """Complete the experts' gradients once per optimizer step, where the data engine does not."""

    def describe(self) -> str | None:
        return None


class ExpertParallel(WholeExperts):
    """Expert parallelism over groups of ``degree`` data-parallel ranks (one per ``Parallel``)."""

    splits = True

    def __init__(self, degree: int) -> None:
        import torch
        from torch.distributed.device_mesh import DeviceMesh

        if not hasattr(DeviceMesh, "_unflatten"):  # what the expert groups are carved out of the data mesh with
            raise ConfigError(
                f"ep={degree} needs torch 2.10 or later (DeviceMesh._unflatten), this is torch "
                f"{torch.__version__}; upgrade torch or train without ep"
            )
        self.degree = degree
        self._layers: list[Any] = []
        self._mesh: Any = None
        self._dp = 1
        self._reduces = False
        """Whether :meth:`sync_gradients` completes the experts' gradients (no data engine reduces them)."""

    def step(
        self, mesh: Any, device: Any, zero: int, fsdp_kwargs: dict[str, Any], stage: bool = False, tp: Any = None
    ) -> Step:
        from torch.distributed.fsdp import CPUOffloadPolicy

        from ...model.materialize import is_meta, to_device
        from .experts import dispatch_experts, find_experts
        from .layout import expert_mesh, ignored_by_data_parallel, shard_experts, split_experts

        def step(model: nn.Module) -> nn.Module:
            if not is_meta(model):
                model = to_device(model, device)  # the slices are made where the model trains
            layers = find_experts(model, self.degree, required=not stage)
            if self._mesh is None:  # every rank builds it (a collective), its stages holding experts or not
                self._mesh, self._dp = expert_mesh(mesh, self.degree), mesh.size()
                # ZeRO shards the slices again over the ranks holding the same ones; where one rank holds each
                # (ep = the data ranks) a unit of one rank would only copy them (CPU offload still wants the unit)
                offloaded = isinstance(fsdp_kwargs.get("offload_policy"), CPUOffloadPolicy)
                self._reduces = not zero or (self._mesh["ep_dp"].size() == 1 and not offloaded)
            self._layers += layers  # a rank's several pipeline stages (interleaved schedules) add theirs
            split_experts(layers, self._mesh, replicate=self._reduces)
            policy = fsdp_kwargs.get("mp_policy")
            for layer in layers:  # their own compute dtype where no FSDP unit casts them
                dispatch_experts(
                    layer,
                    self._mesh.get_group("ep"),
                    getattr(policy, "param_dtype", None) if zero and self._reduces else None,
                    tp if tp is not None and tp.size() > 1 else None,
                )
            if self._reduces:
                ignored_by_data_parallel(model, layers)
            else:
                shard_experts(layers, self._mesh, self._dp, **fsdp_kwargs)
            return model

        return step

    def modules(self, model: nn.Module) -> list[nn.Module]:
        from .experts import find_experts

        return [layer.module for layer in find_experts(model, self.degree, required=False)]

    def check(self, model: nn.Module) -> None:
        from .experts import find_experts

        find_experts(model, self.degree)

    def sync_gradients(self, model: nn.Module) -> None:
        if self._reduces:
            from .layout import reduce_expert_grads

            reduce_expert_grads(self._layers, self._mesh, self._dp)

    def describe(self) -> str | None:
        return f"ep={self.degree}"
