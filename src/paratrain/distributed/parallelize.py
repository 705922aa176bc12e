"""``parallelize``: the order in which paratrain applies its techniques to a model, stated once.

precision (bf16-true's dtype) → tensor parallelism → context parallelism → activation checkpointing → compile →
expert parallelism → model parallelism and data parallelism (DDP, FSDP, replicate). Every strategy calls it with the
steps it takes (``tp``, ``cp``, ``ep``, ``data``) on the whole model, a pipeline on each of its stages with the same
data engine (as torchtitan applies one ``parallelize_fn`` to every model part). The order is torchtitan's: tensor
parallelism first, so the blocks that are checkpointed and compiled are the split ones (compiling traces DTensor code,
not code a later split invalidates); the sequence split next, hooking the split model's calls; sharding last, so
FSDP's hooks stay outside the checkpointed and compiled blocks. Expert parallelism lays the experts out just before
the data engine, in the layout that engine gives them (left to their own reduction beside DDP, sharded on their own
mesh before FSDP shards the blocks around them).

A model built on the meta device is materialized (:mod:`paratrain.model.materialize`) once, at the last point where
every step before it took meta tensors: after the data step when that step shards meta tensors (FSDP2's
``fully_shard``, marked ``takes_meta``: each rank then allocates only its shard, the experts split on meta too),
before the expert and data steps otherwise (DDP and FSDP2's ``replicate`` hold a full replica, and DDP broadcasts real
tensors). Tensor parallelism always runs on meta, so a rank allocates only its slice.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import ConfigError
from ..model.facts import ModelFacts
from ..model.transforms import transform_blocks
from ..options import BlockTransforms
from ..precision import Precision

Step = Callable[[nn.Module], nn.Module]


def takes_meta(step: Step) -> Step:
    """Mark a data step that can lay out a model still on the meta device (FSDP2 shards meta tensors)."""
    step.takes_meta = True  # type: ignore[attr-defined]
    return step


def parallelize(
    model: nn.Module,
    *,
    precision: Precision,
    facts: ModelFacts,
    transforms: BlockTransforms,
    tp: Step | None = None,
    cp: Step | None = None,
    ep: Step | None = None,
    data: Step | None = None,
    materialize: Callable[[nn.Module], object] | None = None,
) -> nn.Module:
    """``model`` (or one pipeline stage of it) with every technique applied in the stated order; ``tp`` splits its
    layers, ``cp`` its sequences, ``ep`` its experts, ``data`` places and wraps it for model and data parallelism;
    ``materialize`` (a model built on the meta device) allocates and initializes what this rank holds. Returns the
    module to train."""
    if (tp is not None or cp is not None) and transforms.checkpoint_every and transforms.compile is not None:
        raise ConfigError(
            f"activation checkpointing with compile fails under tensor parallelism on torch "
            f"{torch.__version__}: its compiler cannot recompute a block of DTensors; drop one of them "
            "(compile=True alone, or activation_checkpointing alone)"
        )
    model = precision.convert_module(model)
    for step in (tp, cp):
        model = step(model) if step is not None else model
    transform_blocks(model, facts, transforms)
    late = materialize is not None and getattr(data, "takes_meta", False)
    if materialize is not None and not late:
        materialize(model)
    for step in (ep, data):
        model = step(model) if step is not None else model
    if late:
        materialize(model)  # type: ignore[misc]
    return model
