"""The data- and tensor-parallel strategies as presets: a name → how its ranks divide and what realises its data
dimension. One class (:class:`~paratrain.strategies.composed.Composed`) runs every row, so ``ddp`` and
``zero3`` with ``tp=2`` differ by a row of this table, not by a subclass.

The pipelines, in-process model parallelism and ``nn.DataParallel`` are engines of their own
(:mod:`.pipeline`, :mod:`.model_parallel`, :mod:`.dp`), registered beside these names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..composition import Takes, takes
from .data_engines import OneReplica, Replicas, ShardedOptimizer, Shards


@dataclass(frozen=True)
class Preset:
    """A named layout of data and tensor parallelism."""

    name: str
    engine: type[OneReplica]
    """What realises the data-parallel dimension (its ZeRO stage comes from it)."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Option values of this preset where its engine's defaults differ (zero2 keeps parameters gathered)."""
    groups: bool = True
    """False: one process, no process group (``single``)."""
    hierarchical: bool = False
    """Shard within groups of ranks and replicate across them (HSDP: a replicate x shard mesh)."""
    aliases: tuple[str, ...] = ()

    @property
    def takes(self) -> Takes:
        """Which of tp, cp and ep it composes with: :data:`paratrain.composition.TAKES`' row."""
        return takes(self.name)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset("single", OneReplica, groups=False),
        Preset("ddp", Replicas),
        Preset("zero1", ShardedOptimizer),
        Preset("zero2", Shards, defaults={"reshard_after_forward": False}),
        Preset("zero3", Shards, aliases=("fsdp",)),
        Preset("hsdp", Shards, hierarchical=True),
        Preset("tp", OneReplica),
    )
}


def preset_named(name: str) -> Preset:
    """The preset called ``name`` or by one of its aliases (``fsdp``: ``zero3``)."""
    return next(p for p in PRESETS.values() if name in (p.name, *p.aliases))
