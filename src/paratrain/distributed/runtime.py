"""What a strategy, and each part it composes (tensor, context and expert parallelism), needs to know about the
running job and the model being prepared: one object handed down whole."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..env import ClusterEnv
from ..model.facts import ModelFacts
from ..options import BlockTransforms
from ..precision import Precision
from .parallelize import Step, parallelize


@dataclass(frozen=True)
class Runtime:
    """What a strategy needs to know about the running job (and, while preparing one, about the model)."""

    env: ClusterEnv
    device: torch.device
    mesh: DeviceMesh | None
    precision: Precision
    facts: ModelFacts | None = None
    """The model being prepared (or whose optimizer is): its blocks, ties and parameter names."""
    transforms: BlockTransforms = BlockTransforms()
    """Activation checkpointing and compilation of the blocks."""
    checkpointing: bool = False
    """The job saves checkpoints on its own (``checkpoint_dir``): every rank must then stay to the end."""
    materialize: Callable[[nn.Module], object] | None = None
    """For a model built on the meta device: allocates and initializes what this rank holds of a laid-out module
    (:class:`~paratrain.model.materialize.Materializer`)."""

    def parallelize(
        self,
        model: nn.Module,
        tp: Step | None = None,
        cp: Step | None = None,
        ep: Step | None = None,
        data: Step | None = None,
    ) -> nn.Module:
        """:func:`~paratrain.distributed.parallelize.parallelize` with this job's precision and block transforms."""
        assert self.facts is not None, "parallelize needs the model's facts"
        return parallelize(
            model,
            precision=self.precision,
            facts=self.facts,
            transforms=self.transforms,
            tp=tp,
            cp=cp,
            ep=ep,
            data=data,
            materialize=self.materialize,
        )
