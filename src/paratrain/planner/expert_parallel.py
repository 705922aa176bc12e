"""Expert parallelism as the planner sees it: what one rank of an expert-parallel group holds, and what it moves.

``Parallel(strategy, ep=E)`` (``ParallelDims.ep``): each rank of a group of E data-parallel ranks holds E/ep whole
experts of every MoE block, 1/E of them; each token's hidden state goes to the ranks holding its top k experts and
the experts' outputs come back, an all-to-all each way in forward and their gradients' in backward (again in a
recomputed forward). No token is dropped and routing is taken as balanced: a rank computes, on average, as many
expert rows as its own tokens make, so compute does not change with E. Under ZeRO the experts are sharded over the
dp_shard/E ranks left (torchtitan's layout, ``expert_fraction``), whose gradients are theirs to reduce; the dense
parameters are synced over every data-parallel rank as without ep.

The compositions planned (``layout.layouts``, the runtime's): ddp, zero2 and zero3 with ep; the same over groups of tp
ranks with ep (``Parallel("zero3", tp=T, ep=E)``); and ``hybrid`` with ep (``Parallel("hybrid", dp=D, ep=E)``: each
pipeline stage's experts split over groups of E of its D replicas). Tensor parallelism splits attention and the
dense MLPs, not the routed experts: every rank of a tp group holds its ep slice of the experts whole, but beside ep
the ranks of a tp group, given the same tokens, divide them: each computes the routed experts of its 1/tp share
(``moe_flops(stats, tp)``: routed-expert FLOPs per rank divided by tp x ep's balanced routing; the router and
shared experts, and what the MoE blocks save for backward, stay whole: tp runs each MoE block whole); its ep group
is made of data-parallel ranks, one per tp group, so the all-to-alls cross the link the dp dimension uses
(``link_of``).

Per micro-batch of b samples of s tokens, a rank sends in each all-to-all b·s·k·h/tp elements of the compute dtype
(its tp share of the tokens), (E−1)/E of them off the rank: 4 all-to-alls an MoE block (6 with recomputation),
none hidden; a pipeline stage those of its own blocks. Beside tp the share costs collectives over the tp link too
(``tp_share_comm_s``): the outputs and the rows' gradients gathered, the experts' gradients summed.
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from .collectives import all_gather_s, all_reduce_s, all_to_all_s
from .hardware import Cluster, Link, degree_to_plan
from .layout import Layout
from .model_stats import ELEMENT_BYTES, ModelStats
from .tensor_parallel import rank_units


def held_units(stats: ModelStats, tp: int, ep: int) -> tuple[tuple[str, int], ...]:
    """The wrap units as the first rank of a tp and an ep group holds them: tensor-parallel splits 1/tp
    (``tensor_parallel.rank_units``), routed experts 1/ep."""
    units = rank_units(stats, tp)
    if ep == 1 or stats.moe is None:
        return units
    return tuple((name, n - x + x // ep) for (name, n), x in zip(units, stats.moe.unit_experts))


def held_experts(stats: ModelStats, ep: int) -> tuple[int, ...]:
    """Routed experts' parameters one rank holds in each unit: 1/ep of them (zeros for a dense model)."""
    if stats.moe is None:
        return (0,) * len(stats.units)
    return tuple(x // ep for x in stats.moe.unit_experts)


def expert_fraction(stats: ModelStats, layout: Layout) -> float:
    """The share of its experts one rank keeps when ZeRO shards them over the shard/ep ranks holding the same ones:
    1/(shard/ep), as the runtime cuts them (on each expert's rows where those ranks do not divide the experts, as
    torchtitan does: ``distributed.expert_parallel.layout.shard_experts``). Without ep, FSDP's units cut each fused
    expert tensor on its first dimension, the experts: a rank keeps ceil(E / shard) of the E experts, more than
    1/shard when the ranks outnumber the experts (torch pads the rest: at 64 ranks a rank keeps 1/8 of Mixtral's 8,
    as the dry run reads)."""
    ranks = layout.shard_ranks // layout.ep
    if layout.zero >= 2 and layout.ep == 1 and stats.moe is not None:
        return math.ceil(stats.moe.experts / ranks) / stats.moe.experts
    return 1 / ranks


def sync_groups(dense: float, experts: float, ranks: int, layout: Layout) -> list[tuple[float, int, int]]:
    """(parameters, ranks, spacing) of each group a rank syncs its parameters over (an all-reduce, or a ZeRO
    shard's gathers and reduce-scatters): all of them over ``ranks`` data-parallel ranks, or under ep the dense ones
    so and its experts over the ranks/ep holding the same ones, ep times further apart."""
    if layout.ep == 1 or not experts:
        return [(dense + experts, ranks, 1)]
    return [(dense, ranks, 1), (experts, ranks // layout.ep, layout.ep)]


def tokens_per_rank(stats: ModelStats, micro_batch: float, tp: int = 1) -> float:
    """Token rows one rank sends to its experts per micro-batch and MoE block (each token once per expert it goes
    to): a tp rank's share, 1/``tp`` of its group's tokens (``distributed.expert_parallel.tp_share``)."""
    if stats.moe is None:
        return 0.0
    return micro_batch * stats.moe.seq_len * stats.moe.top_k / tp


def dispatch_bytes(stats: ModelStats, mode: str, micro_batch: float, tp: int = 1) -> float:
    """Bytes one rank sends in one all-to-all of an MoE block: its share of its micro-batch's tokens' k copies of
    the hidden state (``tokens_per_rank``: 1/tp of them beside ``tp``), in the compute dtype of ``mode``
    (``ELEMENT_BYTES``)."""
    if stats.moe is None:
        return 0.0
    return tokens_per_rank(stats, micro_batch, tp) * stats.moe.hidden * ELEMENT_BYTES[mode][1]


def ep_comm_s(
    stats: ModelStats,
    mode: str,
    micro_batch: float,
    ep: int,
    link: Link,
    checkpointing: bool,
    stages: int = 1,
    tp: int = 1,
) -> float:
    """Seconds of one micro-batch's all-to-alls on one rank: per MoE block the dispatch and the combine in forward,
    their gradients in backward, and a recomputed forward's two more; a pipeline stage's 1/``stages`` of the
    blocks; a tp rank's share of the tokens."""
    if ep == 1 or stats.moe is None:
        return 0.0
    calls = (6 if checkpointing else 4) * stats.moe.layers / stages
    return calls * all_to_all_s(dispatch_bytes(stats, mode, micro_batch, tp), ep, link)


def tp_share_comm_s(
    stats: ModelStats,
    mode: str,
    micro_batch: float,
    tp: int,
    ep: int,
    link: Link,
    checkpointing: bool,
    stages: int = 1,
) -> float:
    """Seconds of one micro-batch's collectives over tp that dividing the tokens costs beside ep
    (``distributed.expert_parallel.tp_share``), on the tp link: per MoE block the outputs gathered in forward (again
    in a recomputed one) and the rows' gradients gathered in backward (b·s·h each, the compute dtype), and the
    rank's experts' gradients summed over tp (X/ep of the stage, the parameters' dtype), every micro-batch; none
    without both tp and ep."""
    if tp == 1 or ep == 1 or stats.moe is None:
        return 0.0
    m, (param, compute) = stats.moe, ELEMENT_BYTES[mode]
    rows = micro_batch * m.seq_len * m.hidden * compute
    gathers = (3 if checkpointing else 2) * m.layers / stages * all_gather_s(rows, tp, link)
    return gathers + all_reduce_s(m.expert_params / ep / stages * param, tp, link)


def moe_flops(stats: ModelStats, tp_share: int = 1) -> float:
    """FLOPs per sample of the MoE blocks' MLPs on one rank (6 a weight, forward and backward, for each of the s
    tokens: the k of the E routed experts a token goes through, the router and the shared experts): the share of a
    step tensor parallelism does not split, as it runs each MoE block whole on every rank. Beside ep the ranks of a
    tp group divide its tokens' routed experts: ``tp_share`` = tp divides that part."""
    if stats.moe is None:
        return 0.0
    m = stats.moe
    return 6.0 * m.seq_len * (m.expert_params * m.top_k / m.experts / tp_share + m.whole)


def ep_degrees(stats: ModelStats, cluster: Cluster, ep: int | None = None) -> tuple[int, ...]:
    """Expert-parallel degrees to plan: ``ep`` when given (1: none), else every power of two >= 2 that divides a
    node's ranks and the experts (the all-to-alls stay on the node's link). A dense model gets none."""
    if not degree_to_plan(
        "ep",
        ep,
        stats.moe,
        f"splits a mixture of experts' experts: {stats.name!r} has none (plan "
        "a preset such as mixtral-8x7b, or an MoE config.json)",
    ):
        return ()
    if ep is not None:
        why = stats.moe.why_not(ep)
        if why is not None:
            fits = [d for d in range(1, stats.moe.experts + 1) if stats.moe.experts % d == 0]
            raise ConfigError(f"--ep {ep}: {why}; use one of {', '.join(map(str, fits))}")
        return (ep,)
    return cluster.node_degrees(stats.moe.why_not)


def link_of(cluster: Cluster, layout: Layout) -> Link:
    """The link an ep group's all-to-alls cross: ep data-parallel ranks, a pipeline's stages and a tp group apart
    (the dp dimension's spacing, ``hybrid``'s and tp's alike)."""
    return cluster.link_for(layout.ep, layout.stages * layout.tp)
