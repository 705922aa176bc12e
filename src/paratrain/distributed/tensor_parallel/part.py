"""The part of a strategy that splits layers over ranks, and its absence.

Every strategy holds one (``Strategy.tp``) and calls its hooks unconditionally: :class:`WholeLayers`, every layer
whole on every rank, does nothing at each; :class:`~paratrain.distributed.tensor_parallel.compose.TensorParallel`
splits them. So no strategy branches on whether tensor parallelism is on, and this module stays light to import
(``torch.distributed.tensor`` takes a second; only the splitting part imports it).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from ...batch import ModelCall
    from ..runtime import Runtime

Step = Callable[[nn.Module], nn.Module]
Leave = Callable[[nn.Module], "list[nn.Module]"]
"""A model's modules another part lays out, which tensor parallelism leaves plain and whole (the routed experts)."""
DataParallel = tuple[int, int, "dist.ProcessGroup | None"]


class WholeLayers:
    """No tensor parallelism: layers whole on every rank; every hook gives the strategy's own answer back."""

    splits = False
    """Parameters become DTensors split over ranks (the data engine then wraps them accordingly)."""

    def degree(self, strategy: str, world_size: int) -> int:
        """Ranks that split each layer."""
        return 1

    def splitter(self, rt: Runtime, leave: Leave | None = None) -> Step | None:
        """The step that splits a model's layers over ``rt``'s mesh
        (:func:`~paratrain.distributed.parallelize.parallelize`'s ``tp``), but the modules ``leave`` names; None:
        nothing to split."""
        return None

    def stage_splitter(
        self, model: nn.Module, rt: Runtime, first_block: str | None, last_block: str | None
    ) -> Step | None:
        """The same for one pipeline stage of ``model``, its boundaries whole (``first_block``, ``last_block``: the
        blocks where the stage begins and ends inside the model, None at the model's own ends)."""
        return None

    def check_stages(self, model: nn.Module, strategy: str) -> None:
        """Raise a one-line ``ConfigError`` when ``model`` cannot be cut into split stages."""

    def data_parallel(self, mesh: DeviceMesh | None, whole: DataParallel) -> DataParallel:
        """(rank, size, group) of the replicas that read different data: ``whole``'s when nothing is split."""
        return whole

    def rng_rank(self, mesh: DeviceMesh | None, whole: int) -> int:
        """The index seeding this rank's random stream: ``whole`` when nothing is split."""
        return whole

    def forward_backward(self, model: nn.Module, call: ModelCall, scale: float) -> torch.Tensor | None:
        """Forward and backward of one micro-batch when the split changes how the loss runs; None: it does not."""
        return None

    def head_loss_refusal(self) -> str | None:
        """Why the split stops the loss from being computed at the head in chunks, or None."""
        return None

    def split_loss(self) -> AbstractContextManager:
        """Context of a loss computed on split logits (a pipeline's last stage)."""
        return nullcontext()

    def sync_gradients(self, model: nn.Module) -> None:
        """Complete gradients the split leaves as per-rank parts, once per optimizer step."""

    def optimizer_stepping(self, optimizer: torch.optim.Optimizer) -> AbstractContextManager:
        """Context of the optimizer step."""
        return nullcontext()

    def every_rank_reason(self, strategy: str) -> str | None:
        """Why the split model's forward needs every rank of a group (words for a one-line error), or None."""
        return None

    def traffic_bytes(self, known: int | None) -> int | None:
        """Bytes a rank moves per step: ``known`` (the data engine's count) when nothing is split; None where the
        split's own traffic is not counted."""
        return known

    def describe(self) -> str | None:
        return None
