"""Tensor parallelism as the planner sees it: what a transformer's TP plan splits, and what it communicates.

The plan is Megatron's (Shoeybi et al. 2019) with sequence parallelism (Korthikanti et al. 2022), as torchtitan
applies it with ``torch.distributed.tensor.parallel``: per block, the attention's QKV projection and the MLP's
first linear column-parallel, the attention output and the MLP's second linear row-parallel, the norms sequence
parallel (activations between the split regions sharded on the sequence); a vocab-parallel embedding and head,
and the loss on vocab-sharded logits. What that costs per micro-batch of b samples over t ranks:

- each split region opens with an all-gather of its input and closes with a reduce-scatter of its output, both
  b·s·h elements: per block 2 of each in forward and, as their gradients, 2 of each in backward (a
  checkpointed block's recompute: 2 more of each); the embedding reduce-scatters its output and the head
  all-gathers its input (and their gradients in backward); the loss all-reduces 3 values per token (max, sum of
  exponentials, the target's logit).
- parameters of the split layers are 1/t per rank; norms, position embeddings and the row-parallel layers'
  biases stay whole.
- activations are 1/t except each column-parallel linear's input, which autograd saves as gathered (whole:
  torch does not re-gather it in backward, unlike Megatron), and the token ids and targets.
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from .collectives import all_gather_s, all_reduce_s, reduce_scatter_s
from .hardware import Cluster, Link, degree_to_plan
from .model_stats import ELEMENT_BYTES, ModelStats, TPShape

LOSS_ALL_REDUCES = 3
"""Vocab-parallel cross-entropy's all-reduces of one fp32 value per token: max, sum of exponentials, target logit."""


def rank_units(stats: ModelStats, tp: int) -> tuple[tuple[str, int], ...]:
    """The wrap units as the first tensor-parallel rank holds them: split parameters 1/tp (rounded up: an uneven
    vocabulary's first ranks hold a row more), the rest whole."""
    if tp == 1:
        return stats.units
    shape = _shape(stats)
    return tuple((name, n - s + math.ceil(s / tp)) for (name, n), s in zip(stats.units, shape.split))


def rank_params(stats: ModelStats, tp: int) -> int:
    """Parameters one tensor-parallel rank holds of the whole model: all but what its split leaves to the other
    ranks (a weight shared by two units, a tied head, is split once: ``TPShape.split``)."""
    return stats.params if tp == 1 else stats.params - sum(s - math.ceil(s / tp) for s in _shape(stats).split)


def rank_activations(
    stats: ModelStats, figures: tuple[float, float, float], mode: str, tp: int, sequence_parallel: bool = True
) -> tuple[float, float, float]:
    """Per-sample (activations, checkpointed, boundary) bytes on one of ``tp`` ranks, from the whole model's
    ``figures`` under ``mode`` (``ELEMENT_BYTES``' keys): 1/tp, except the column-parallel linears' gathered inputs
    (two per block, one for the head) and the token ids and targets (16 bytes a token), which every rank keeps
    whole (never more than ``figures`` hold: stats of parameters alone hold none); a checkpointed model keeps one
    block's. The boundary, a block's output, is sequence-sharded.

    Without sequence parallelism every rank also keeps whole what lies between the split regions: each block's
    input and the residual after attention (residual dtype), so also each checkpointed block's input, and the
    boundary. Korthikanti et al. (2022, table 2) count the same split: ``sbh(10 + 24/t)`` against ``34·sbh/t``
    (their 10: the norms' inputs and the dropout masks; a model without dropout keeps the residuals instead).

    A mixture of experts' MoE blocks run whole on every tp rank over the gathered sequence: what their MLPs save
    (``MoEShape.mlp_activations``; a checkpointed model one block's) is kept whole too."""
    if tp == 1:
        return figures
    shape = _shape(stats)
    if not shape.splits_activations:
        return figures
    sequence_parallel = sequence_parallel and shape.sequence_parallel
    r, c = ELEMENT_BYTES[mode]
    sh, ids = shape.seq_len * shape.hidden, 16.0 * shape.seq_len
    moe = stats.moe.mlp_activations.get(mode, 0.0) if stats.moe is not None else 0.0
    moe_block = moe / stats.moe.layers if moe else 0.0
    acts, checkpointed, boundary = figures
    if sequence_parallel:
        whole = (
            min(acts, shape.layers * 2 * c * sh + c * sh + ids + moe),
            min(checkpointed, 3 * c * sh + ids + moe_block),
        )
        return (whole[0] + (acts - whole[0]) / tp, whole[1] + (checkpointed - whole[1]) / tp, boundary / tp)
    whole = (
        min(acts, shape.layers * 2 * (c + r) * sh + c * sh + ids + moe),
        min(checkpointed, shape.layers * r * sh + 2 * (c + r) * sh + c * sh + ids + moe_block),
    )
    return (whole[0] + (acts - whole[0]) / tp, whole[1] + (checkpointed - whole[1]) / tp, boundary)


def collective_bytes(stats: ModelStats, mode: str, micro_batch: float) -> tuple[float, float]:
    """Bytes of one TP all-gather or reduce-scatter of a micro-batch's activations, (residual, compute) dtype."""
    shape = _shape(stats)
    r, c = ELEMENT_BYTES[mode]
    elements = micro_batch * shape.seq_len * shape.hidden
    return elements * r, elements * c


def tp_comm_s(stats: ModelStats, mode: str, micro_batch: float, tp: int, link: Link, checkpointing: bool) -> float:
    """Seconds of one micro-batch's tensor-parallel collectives over ``link`` (they are not overlapped).

    Per block, forward all-gathers the norms' outputs (residual dtype) and reduce-scatters the row-parallel
    outputs (compute dtype), two each; backward does the reverse on their gradients; a recompute repeats forward.
    The embedding's reduce-scatter and the head's all-gather, and their gradients, carry the residual dtype.
    """
    if tp == 1:
        return 0.0
    shape = _shape(stats)
    residual, compute = collective_bytes(stats, mode, micro_batch)
    passes = 2 if checkpointing else 1
    block = passes * 2 * (all_gather_s(residual, tp, link) + reduce_scatter_s(compute, tp, link)) + 2 * (
        reduce_scatter_s(residual, tp, link) + all_gather_s(compute, tp, link)
    )
    ends = 2 * (all_gather_s(residual, tp, link) + reduce_scatter_s(residual, tp, link))
    loss = LOSS_ALL_REDUCES * all_reduce_s(4 * micro_batch * shape.seq_len, tp, link)
    return shape.layers * block + ends + loss


def collectives_per_micro_batch(stats: ModelStats, checkpointing: bool) -> int:
    """Tensor-parallel collective calls per micro-batch (see ``tp_comm_s``)."""
    per_block = 8 + (4 if checkpointing else 0)
    return _shape(stats).layers * per_block + 4 + LOSS_ALL_REDUCES


def tp_degrees(stats: ModelStats, cluster: Cluster, tp: int | None = None) -> tuple[int, ...]:
    """Tensor-parallel degrees to plan: ``tp`` when given (1: none), else every power of two >= 2 that divides a
    node's ranks and the model (``TPShape.why_not``). Models without a TP shape get none: those the runtime
    refuses (``ModelStats.refused``), and traced ones planned without the runtime's view."""
    if not degree_to_plan("tp", tp, stats.tp, missing_shape(stats, "tp", "a built-in GPT or --params")):
        return ()
    if tp is not None:
        why = stats.tp.why_not(tp)
        if why is None and cluster.world_size % tp:
            why = f"tp={tp} does not divide the {cluster.world_size} ranks"
        if why is not None:
            common = math.gcd(cluster.world_size, *(n for _, n in stats.tp.divides))
            fits = [t for t in range(1, min(common, 2 * cluster.ranks_per_node) + 1) if common % t == 0]
            raise ConfigError(f"--tp {tp}: {why}; use a degree that divides them: {', '.join(map(str, fits))}")
        return (tp,)
    return cluster.node_degrees(stats.tp.why_not)


def missing_shape(stats: ModelStats, flag: str, shaped: str) -> str:
    """The rest of ``--tp``'s or ``--cp``'s one line for a model without the shape: the runtime's refusal, else that
    the planner knows no shape for it."""
    why = stats.refused.get(flag)
    if why is not None:
        return f"for {stats.name!r} is refused by the runtime: {why}"
    return f"needs a transformer's shape: {stats.name!r} is not {shaped}"


def _shape(stats: ModelStats) -> TPShape:
    if stats.tp is None:
        raise ConfigError(f"model {stats.name!r} has no tensor-parallel shape; plan tp with a transformer")
    return stats.tp
