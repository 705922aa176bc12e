"""The data- and tensor-parallel strategies as presets: a name → how its ranks divide and what realises its data
dimension. One class (:class:`~paratrain.strategies.composed.Composed`) runs every row, so ``ddp`` and
``zero3`` with ``tp=2`` differ by a row of this table, not by a subclass.

The pipelines, in-process model parallelism and ``nn.DataParallel`` are engines of their own
(:mod:`.pipeline`, :mod:`.model_parallel`, :mod:`.dp`), registered beside these names.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from .data_engines import OneReplica, Replicas, ShardedOptimizer, Shards


@dataclass(frozen=True)
class Preset:
    """A named layout of data and tensor parallelism."""

    name: str
    engine: type[OneReplica]
    """What realises the data-parallel dimension (its ZeRO stage comes from it)."""
    tp: Literal["option", "all", "never"] = "option"
    """``option``: ``tp=N`` makes groups of N ranks that split each layer; ``all``: every rank splits each layer;
    ``never``: the preset does not compose with tensor parallelism."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Option values of this preset where its engine's defaults differ (zero2 keeps parameters gathered)."""
    groups: bool = True
    """False: one process, no process group (``single``)."""
    cp: bool = True
    """Whether ``cp=N`` (ranks that split each sequence) composes with the preset."""
    hierarchical: bool = False
    """Shard within groups of ranks and replicate across them (HSDP: a replicate x shard mesh)."""
    ep: bool = False
    """Takes ``ep=N``: groups of N data-parallel ranks split every mixture-of-experts layer's experts."""
    aliases: tuple[str, ...] = ()


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("single", OneReplica, tp="never", groups=False, cp=False),
    Preset("ddp", Replicas, ep=True),
    Preset("zero1", ShardedOptimizer, cp=False),
    Preset("zero2", Shards, defaults={"reshard_after_forward": False}, ep=True),
    Preset("zero3", Shards, aliases=("fsdp",), ep=True),
    Preset("hsdp", Shards, tp="never", hierarchical=True),
    Preset("tp", OneReplica, tp="all", cp=False),
)}
