"""ZeRO-1: an optimizer's states sharded over data-parallel ranks by torch's ``ZeroRedundancyOptimizer``, which
gives each rank whole parameters to step and then broadcasts every rank's updated parameters to the others.

Imported when used: it imports ``torch.distributed.optim`` and DTensor (1-2 s).

Tensor-parallel parameters are DTensors, and ``ZeroRedundancyOptimizer`` broadcasts ``param.data`` through c10d,
which has no DTensor rule ("Operator c10d.broadcast_.default does not have a sharding strategy registered", torch
2.13). Every rank of one data-parallel group holds the same shard of such a parameter (the same position in its
tensor-parallel group), so broadcasting that shard's local tensor is the whole update: ``_LocalShards`` does only
that. The partition, the local optimizer (stepping the DTensors as a tensor-parallel model's optimizer does) and its
state are torch's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from .optimizer import constructor_defaults, step_by_layout


def zero_redundancy(
    groups: list[dict[str, Any]], optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None
) -> ZeroRedundancyOptimizer:
    """``optimizer``'s class and settings over ``groups`` (param groups holding no state yet), its states sharded
    over ``group``'s ranks (None: the default group)."""
    split = any(isinstance(p, DTensor) for g in groups for p in g["params"])
    cls = _LocalShards if split else ZeroRedundancyOptimizer
    return cls(groups, optimizer_class=type(optimizer), process_group=group, **constructor_defaults(optimizer))


class _LocalShards(ZeroRedundancyOptimizer):
    """``ZeroRedundancyOptimizer`` over DTensor parameters: each rank broadcasts the local tensors of the
    parameters it stepped (see the module docstring). Parameters are never bucketed (``parameters_as_bucket_view``
    would replace DTensor storage with plain views). The local optimizer steps each param group by layout
    (:func:`.optimizer.step_by_layout`): a rank's part can hold plain parameters beside DTensors."""

    def _init_local_optimizer(self) -> None:
        super()._init_local_optimizer()
        step_by_layout(self.optim)

    def _broadcast_params_from_rank(self, rank: int) -> list[dist.Work]:
        src = dist.get_global_rank(self.process_group, rank)
        return [
            dist.broadcast(_local(p.data), src=src, group=self.process_group, async_op=True)
            for group in self._partition_parameters()[rank]
            for p in group["params"]
        ]


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t
