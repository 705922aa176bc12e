"""Context parallelism as the planner sees it: what one rank of a cp group holds, computes and sends.

``Parallel(strategy, cp=C)`` (``ParallelDims.cp``, Ulysses): the C ranks of a group read the same samples and each
holds 1/C of every sequence. Outside attention every token is computed where it lives; around attention an
all-to-all turns each of the queries, keys and values from a sequence split (s/C tokens, all heads) into a head
split (all s tokens, 1/C of the heads) and one more turns the attention's output back: 4 all-to-alls a layer in
forward, their gradients' 4 in backward (and a recomputed forward's 4). A rank then computes 1/C of every FLOP,
the attention's included (all s x s scores of its 1/C of the heads), and saves 1/C of every activation: the
tensors attention saves hold s x a/C x d elements where the rest hold s/C x a x d. What is not split: the weights
(each rank streams them all, and under autocast saves their 16-bit copies), the token ids and targets a sample
is loaded with (16 bytes a token, as under tp), and the all-to-alls' send and receive buffers of one layer.
The cp ranks' gradients are reduced with the data-parallel ranks' (dp x cp), and ZeRO shards over dp x cp.

Per micro-batch of b samples of s tokens, a rank of tp t sends in the queries' and the output's all-to-alls
b·s/C·a·d/t elements of the compute dtype each, in the keys' and values' b·s/C·kv·d/t each, (C−1)/C of them off
the rank; none hidden.

Where tp x cp does not divide the heads, the runtime's ``cp_method="auto"`` runs the all-gather instead
(:func:`~paratrain.composition.cp_method`): per layer the keys and values of the whole sequence, b·s·kv·d/t
elements each, are all-gathered in forward (each rank receiving (C−1)/C of them) and their gradients
reduce-scattered in backward: 2 collectives a layer each way instead of 4 all-to-alls, C·kv/(a+kv) times Ulysses'
bytes (under GQA with a = 8·kv, C/9: less below cp 9, more above).
"""

from __future__ import annotations

from functools import partial

from ..composition import cp_method
from ..errors import ConfigError
from .collectives import all_gather_s, all_to_all_s, reduce_scatter_s
from .hardware import Cluster, Link, degree_to_plan
from .model_stats import ELEMENT_BYTES, CPShape, ModelStats
from .tensor_parallel import missing_shape

IDS_BYTES_PER_TOKEN = 16.0
"""A sample's token ids and targets (int64 each), kept whole by every rank of a cp group."""


def rank_activations(
    stats: ModelStats, figures: tuple[float, float, float], cp: int, mode: str = "fp32", tp: int = 1
) -> tuple[float, float, float]:
    """Per-sample (activations, checkpointed, boundary) bytes on one of ``cp`` ranks from one rank's ``figures``
    without cp: 1/cp of them, plus the token ids and targets every rank keeps whole (never more than ``figures``
    hold); the boundary, a block's output, is all sequence-split. Under the all-gather (:func:`method`) autograd
    saves every layer's whole keys and values where it saved the rank's slice of them."""
    if cp == 1:
        return figures
    shape = _shape(stats)
    ids = IDS_BYTES_PER_TOKEN * shape.seq_len
    acts, checkpointed, boundary = figures
    gathered = 0.0
    if method(stats, tp, cp) == "allgather":
        gathered = shape.layers * 2 * all_gather_bytes(stats, mode, 1, tp) * (1 - 1 / cp)
    return (
        min(acts, ids) + (acts - min(acts, ids)) / cp + gathered,
        min(checkpointed, ids) + (checkpointed - min(checkpointed, ids)) / cp,
        boundary / cp,
    )


def all_to_all_bytes(stats: ModelStats, mode: str, micro_batch: float, tp: int, cp: int) -> tuple[float, float]:
    """Bytes one rank sends in (the queries' or the output's, the keys' or the values') all-to-all of one layer:
    its s/cp tokens' share of those heads on its tp rank, in the compute dtype of ``mode``."""
    shape = _shape(stats)
    tokens = micro_batch * shape.seq_len / cp * ELEMENT_BYTES[mode][1] / tp
    return tokens * shape.heads * shape.head_dim, tokens * shape.kv_heads * shape.head_dim


def all_gather_bytes(stats: ModelStats, mode: str, micro_batch: float, tp: int) -> float:
    """Bytes of one layer's keys (or values) a rank gathers under the all-gather: the whole sequence's, for the
    key/value heads of its tp rank, in the compute dtype of ``mode``."""
    shape = _shape(stats)
    return micro_batch * shape.seq_len * shape.kv_heads * shape.head_dim * ELEMENT_BYTES[mode][1] / tp


def method(stats: ModelStats, tp: int, cp: int) -> str:
    """The exchange the runtime runs for this model at ``tp`` x ``cp`` under ``cp_method="auto"``."""
    shape = _shape(stats)
    return cp_method("auto", shape.heads, shape.kv_heads, tp * cp)


def buffer_bytes(stats: ModelStats, mode: str, micro_batch: float, tp: int, cp: int) -> float:
    """One layer's exchange buffers alive at once: the all-to-alls' send and receive buffers of the queries, keys
    and values, or the all-gather's whole keys and values."""
    if cp == 1:
        return 0.0
    if method(stats, tp, cp) == "allgather":
        return 2 * all_gather_bytes(stats, mode, micro_batch, tp)
    q, kv = all_to_all_bytes(stats, mode, micro_batch, tp, cp)
    return 2 * (q + 2 * kv)


def cp_comm_s(
    stats: ModelStats, mode: str, micro_batch: float, tp: int, cp: int, link: Link, checkpointing: bool
) -> float:
    """Seconds of one micro-batch's exchanges over ``link``: per layer the queries', keys', values' and output's
    all-to-alls in forward, their gradients' in backward, and a recomputed forward's again; under the all-gather
    (:func:`method`) the keys' and values' all-gathers in forward (and recomputed) and their gradients'
    reduce-scatters in backward."""
    if cp == 1:
        return 0.0
    layers, forwards = _shape(stats).layers, 2 if checkpointing else 1
    if method(stats, tp, cp) == "allgather":
        kv = all_gather_bytes(stats, mode, micro_batch, tp)
        return layers * 2 * (forwards * all_gather_s(kv, cp, link) + reduce_scatter_s(kv, cp, link))
    q, kv = all_to_all_bytes(stats, mode, micro_batch, tp, cp)
    layer = 2 * all_to_all_s(q, cp, link) + 2 * all_to_all_s(kv, cp, link)
    return (forwards + 1) * layers * layer


def cp_pairs(
    stats: ModelStats, cluster: Cluster, tp_degrees: tuple[int, ...], cp: int | None = None
) -> tuple[tuple[int, int], ...]:
    """(tp, cp) pairs to plan: for tp 1 and each of ``tp_degrees``, ``cp`` when given (1: none; past the heads: the
    all-gather), else every power of two >= 2 that the model's heads take with that tp (Ulysses) and whose tp x cp
    ranks divide a node (the all-to-alls stay on the node's link, as tp's collectives do). A model without a cp shape
    gets none: one the runtime refuses (``ModelStats.refused``), or one traced without the runtime's view."""
    if not degree_to_plan("cp", cp, stats.cp, missing_shape(stats, "cp", "a built-in GPT, a config.json or --params")):
        return ()
    shape, per_node = stats.cp, cluster.ranks_per_node
    if cp is not None:
        why = shape.why_not(cp, past_heads=True) or (
            f"cp={cp} does not divide the {cluster.world_size} ranks" if cluster.world_size % cp else None
        )
        if why is not None:
            fits = [
                d
                for d in range(1, per_node + 1)
                if shape.why_not(d, past_heads=True) is None and cluster.world_size % d == 0
            ]
            raise ConfigError(f"--cp {cp}: {why}; use one of {', '.join(map(str, fits))}")
        return tuple(
            (t, cp)
            for t in (1, *tp_degrees)
            if shape.why_not(cp, t, past_heads=True) is None and cluster.world_size % (t * cp) == 0
        )
    return tuple(
        (t, c)
        for t in (1, *tp_degrees)
        for c in cluster.node_degrees(partial(shape.why_not, tp=t))
        if per_node % (t * c) == 0
    )


def link_of(cluster: Cluster, tp: int, cp: int) -> Link:
    """The link a cp group's all-to-alls cross: cp ranks a tp group apart."""
    return cluster.link_for(cp, tp)


def _shape(stats: ModelStats) -> CPShape:
    if stats.cp is None:
        raise ConfigError(f"model {stats.name!r} has no context-parallel shape; plan cp with a transformer")
    return stats.cp
