"""What a strategy holds to add tensor parallelism to itself (its :class:`~.part.WholeLayers` part, splitting):
the ``tp`` strategy alone, inside ddp/zero2/zero3, or inside the stages of a pipeline (``pipeline``/``hybrid``,
:mod:`.stage_styles`).

The strategy builds the ``(dp, tp)`` mesh from its :class:`~paratrain.dims.ParallelDims`, splits the model over
``mesh["tp"]`` first, then wraps it for data parallelism over ``mesh["dp"]`` (torchtitan's order: TP, then FSDP or
replication on the parameters TP made). The ranks of one tp group read the same batch and keep one RNG stream
(``rng_rank``), so dropout on replicated activations drops the same units on all of them.
"""

from __future__ import annotations

import warnings
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ...batch import ModelCall
from ...errors import ConfigError
from ...model.facts import ModelFacts
from ...model.materialize import to_device
from ...options import TPConfig
from ...rank_agreement import check_ranks_agree
from ..runtime import Runtime
from .apply import apply_tp
from .degrees import tp_degree
from .infer import choose_plan
from .local_step import replicated_locally
from .outputs import ShardedOutputs, forward_backward
from .part import DataParallel, Leave, Step, WholeLayers
from .plans import TPPlan
from .stage_styles import stage_styles


class TensorParallel(WholeLayers):
    """Tensor parallelism as part of one strategy (one per ``Parallel``)."""

    splits = True

    def __init__(self, config: TPConfig) -> None:
        self.config = config
        self.outputs = ShardedOutputs()
        self._precision: Any = None
        self._device = torch.device("cpu")

    def degree(self, strategy: str, world_size: int) -> int:
        return tp_degree(strategy, self.config.degree, world_size)

    def splitter(self, rt: Runtime, leave: Leave | None = None) -> Step:
        return lambda model: self.apply(model, rt, leave)

    def stage_splitter(self, model: nn.Module, rt: Runtime, first_block: str | None, last_block: str | None) -> Step:
        plan = self.plan(model, rt.facts)

        def split(stage: nn.Module) -> nn.Module:  # a StageModule: the model's copy it runs is .stage
            self.apply_stage(stage.stage, plan, rt, first_block, last_block)  # type: ignore
            return stage

        return split

    def check_stages(self, model: nn.Module, strategy: str) -> None:
        if isinstance(model, nn.Sequential):
            raise ConfigError(
                f"{strategy} with tp cuts a model between its repeated blocks, not an nn.Sequential; "
                "drop tp, or use Parallel('ddp', tp=...) for a tensor-parallel nn.Sequential"
            )

    def apply(self, model: nn.Module, rt: Runtime, leave: Leave | None = None) -> nn.Module:
        """Split ``model`` (moved to ``rt.device``) over ``rt.mesh["tp"]``, but the modules ``leave`` names; a mesh
        without one (tp over a single rank) leaves it whole."""
        mesh, facts = rt.mesh, rt.facts
        assert mesh is not None
        self._precision, self._device = rt.precision, rt.device
        if "tp" not in (mesh.mesh_dim_names or ()):
            return to_device(model, rt.device)
        plan = self._say(choose_plan(model, self.config.plan, mesh["tp"].size(), facts))
        # The router's load-balancing loss is added to the vocabulary-split loss inside the model's forward, a plain
        # tensor beside a DTensor (failing in the backward): such a model's logits are gathered at the head.
        self.outputs.gather_heads |= bool(getattr(getattr(model, "config", None), "output_router_logits", False))
        return apply_tp(
            to_device(model, rt.device),
            mesh["tp"],
            plan,
            self.outputs,
            ties=facts.ties if facts is not None else None,
            leave=leave(model) if leave else (),
        )

    def plan(self, model: nn.Module, facts: ModelFacts | None = None) -> TPPlan:
        """The plan for ``model``, checked against the whole model before a pipeline cuts it into stages (a stage
        lacks the other stages' modules, so a pattern matching none of its own is no mistake there)."""
        plan = self._say(choose_plan(model, self.config.plan, self.config.degree, facts))
        plan.per_module(model)
        return plan

    @staticmethod
    def _say(plan: TPPlan) -> TPPlan:
        """An inferred plan (``tp_plan="auto"``): checked to be the same on every rank (each inferred it from its
        own copy of the model, with a probe whose numbers could differ on another device), its summary printed
        on global rank 0, so the user sees what was split; what it leaves whole of the blocks warned on every rank."""
        if not plan.summary:
            return plan
        if dist.is_initialized():
            check_ranks_agree({"tp_plan='auto' splits": ", ".join(plan.styles)}, dist.get_rank(), dist.get_world_size())
        if not dist.is_initialized() or dist.get_rank() == 0:
            print("\n".join(plan.summary), flush=True)
        if plan.warning is not None:
            warnings.warn(plan.warning, stacklevel=2)
        return plan

    def apply_stage(
        self, stage: nn.Module, plan: TPPlan, rt: Runtime, first_block: str | None, last_block: str | None
    ) -> nn.Module:
        """Split a pipeline stage (the model with other stages' pieces swapped out) over ``rt.mesh["tp"]`` by the
        whole model's ``plan``, its boundaries whole
        (:func:`~paratrain.distributed.tensor_parallel.stage_styles.stage_styles`)."""
        assert rt.mesh is not None
        self._precision, self._device = rt.precision, rt.device
        styles = stage_styles(plan, stage, first_block, last_block)
        return apply_tp(to_device(stage, rt.device), rt.mesh["tp"], plan, self.outputs, styles)

    def data_parallel(self, mesh: DeviceMesh | None, whole: DataParallel) -> DataParallel:
        """The ``dp`` coordinate: ranks of one tp group are one replica."""
        if mesh is None:
            return whole
        dp = mesh["dp"]
        return dp.get_local_rank(), dp.size(), dp.get_group() if dp.size() > 1 else None

    @staticmethod
    def sync_gradients(model: nn.Module) -> None:
        """Sum the gradients left as per-rank parts (``Partial``: weights replicated over tp but used on slices of
        the sequence, the sequence-parallel norms) once per step, before clipping and the optimizer. Left partial,
        every optimizer operation on them all-reduces again (three per parameter for Adam), and torch 2.11's
        distributed checkpoint refuses to save the optimizer state made from them."""
        for p in model.parameters():
            grad = p.grad
            if isinstance(grad, DTensor) and any(pl.is_partial() for pl in grad.placements):
                p.grad = grad.redistribute(
                    grad.device_mesh, [Replicate() if pl.is_partial() else pl for pl in grad.placements]
                )

    @staticmethod
    def optimizer_stepping(optimizer: torch.optim.Optimizer) -> AbstractContextManager:
        """The step updates ``Replicate`` DTensor parameters on their local tensors (:mod:`.local_step`)."""
        return replicated_locally(optimizer)

    def rng_rank(self, mesh: DeviceMesh | None, whole: int) -> int:
        return whole if mesh is None else mesh["dp"].get_local_rank()

    def forward_backward(self, model: nn.Module, call: ModelCall, scale: float) -> torch.Tensor:
        return forward_backward(self.outputs, model, call, scale, self._precision, self._device)

    def head_loss_refusal(self) -> str:
        return (
            "tp splits the head over the vocabulary, and its loss_parallel already keeps each rank to its "
            "slice of the logits"
        )

    def split_loss(self) -> AbstractContextManager:
        return self.outputs.split_loss()

    def every_rank_reason(self, strategy: str) -> str | None:
        return f"under {strategy} with tp every layer is split over the ranks of a tp group"

    def traffic_bytes(self, known: int | None) -> int | None:
        return None  # the split's own all-gathers and reduce-scatters are not counted

    def describe(self) -> str:
        plan = self.config.plan
        return f"tp={self.config.degree or 'all'}" + (
            "" if plan is None else f", tp_plan={plan!r}" if isinstance(plan, str) else ", tp_plan"
        )
