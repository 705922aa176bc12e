"""Tensor parallelism inside pipeline stages: each stage split over its tp group by the model's own plan.

A stage is the model with the other stages' pieces swapped out (:mod:`paratrain.model.stages`), so the plan applies
to the modules the stage runs; a stand-in for another stage's embedding, dropout or head takes no style.

Stage boundaries carry whole tensors. Under the plans' sequence parallelism the residual stream between the blocks
holds a slice of the sequence, but a stage must hand the next one the hidden states one process would: transformers
models derive positions (GPT-2's position ids, Llama's rotary angles, the causal mask) from the length of what they
are given, and a stage's own code after its blocks reshapes by that length (GPT-2's ``view``). Pipelining's shape
pass also sizes the send and receive buffers from the tensors it sees, which must be plain. So the last block of
every stage but the last gathers the sequence (``Shard(1)`` → ``Replicate``, handed on as a plain tensor), and the
first block of every stage but the first slices it again, as the first stage's embedding does: one all-gather per
micro-batch per boundary. Keeping sequence parallelism inside the stages costs less than dropping it under pipelines,
which would need a second plan per model and keep every norm and dropout on the whole sequence on every rank.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from ...model.stages import StandIn
from .plans import TPPlan, matches, sequence_shards, whole_sequence


def stage_styles(
    plan: TPPlan, stage: nn.Module, first_block: str | None, last_block: str | None
) -> list[tuple[str, ParallelStyle]]:
    """(module name, style) for the modules ``stage`` runs, in plan order; under sequence parallelism the
    sequence is sliced before ``first_block`` and gathered after ``last_block`` (None: the stage holds the model's
    own beginning, or end, which the plan handles)."""
    runs = [n for n, m in stage.named_modules() if n and not isinstance(m, StandIn)]
    styles = [
        (n, plan.style(value, pattern, n))
        for pattern, value in plan.styles.items()
        for n in runs
        if matches(pattern, n)
    ]
    if plan.sequence_parallel:
        if first_block is not None:
            styles.append((first_block, sequence_shards()))
        if last_block is not None:
            styles.append((last_block, whole_sequence()))
    return styles
