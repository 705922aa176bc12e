"""The strategy to use for a model on a cluster, among every one estimated (``estimates``), with the reason
(``explain``).

The rule: among strategies that fit (at the requested micro-batch, else a smaller one, else with activation
checkpointing), the fastest; when several are within ``TIE`` (10%) of it, the simplest (ddp before any sharding,
sharding before pipelines). ddp's one all-reduce per step is the least communication, but every ddp rank
repeats the whole optimizer step: on a fast interconnect a ZeRO stage that hides its collectives and steps only
its shard can be faster (with Adam), while a cheap optimizer (SGD) leaves ddp the choice. Pipelines win across
slow inter-node links, where sending activations beats all-reducing gradients. Tensor parallelism, which adds
collectives to every layer, is chosen when it is the only layout that fits or more than ``TIE`` faster than every
layout without it; expert parallelism likewise, after it (its all-to-alls wait on every MoE block), and context
parallelism likewise, after both: it is what long sequences need when their activations fit nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..dims import ParallelDims
from ..errors import ConfigError
from .estimates import Estimate, candidate_layouts, estimate, estimate_layouts, largest_micro_batch, split_error
from .explain import changes, fits_nowhere, plan_notes, unsplit_note, why_chosen, why_exact
from .hardware import Cluster
from .layout import STRATEGY_ORDER
from .model_stats import ModelStats
from .param_server import recommendable
from .training import Training

TIE = 0.10
"""Throughputs within 10% count as equal: the simpler strategy is recommended. Predicted step times land within
about 20% of measured ones on CPU (benchmarks/RESULTS.md §3), so a smaller lead is not evidence enough to pay
for a strategy's extra machinery."""


@dataclass(frozen=True, kw_only=True)
class Plan:
    """The estimates and the recommendation, with what to change and why."""

    stats: ModelStats
    cluster: Cluster
    training: Training
    global_batch: int
    estimates: tuple[Estimate, ...]
    """Every strategy at the requested micro-batch, in ``STRATEGY_ORDER``, then those with tensor parallelism."""
    choice: Estimate | None
    """The recommendation (at a smaller micro-batch when none fits at the requested one); None when the layout asked
    for (``--layout``) fits in no way to run it: its rows say by how much, and ``reason`` what to try."""
    reason: str
    suggestions: tuple[str, ...]
    notes: tuple[str, ...]

    @property
    def lr_factor(self) -> float | None:
        """How many times the batch the user's LR was tuned at (``Training.base_batch``) the global batch is; None
        when that batch was not given."""
        base = self.training.base_batch
        return None if base is None else self.global_batch / base


def recommend(
    stats: ModelStats,
    cluster: Cluster,
    training: Training | None = None,
    *,
    tp: int | None = None,
    exact: ParallelDims | None = None,
    ps_servers: int = 0,
    ep: int | None = None,
    cp: int | None = None,
    strategy: str | None = None,
) -> Plan:
    """The plan for training ``stats``' model on ``cluster``: what ``strategy="auto"`` should pick.

    A strategy that does not fit at the requested micro-batch is tried at smaller ones (same global batch,
    more micro-batches), then with activation checkpointing. Raises ``ConfigError`` when none fits even so, unless
    the layout was asked for (``exact``): it is planned and shown all the same, with no recommendation.
    ``tp``: the tensor-parallel degree to plan (None: every one that fits the model and a node; 1: none).
    ``exact``: the degrees to plan instead of searching (``--layout``); its flavours of data parallelism are
    compared. The global batch must split evenly over each layout's data-parallel replicas (not over the GPUs:
    tensor and pipeline ranks share their replica's samples); layouts it does not split over are left out, and
    when none is left, or the exact layout is one of them, the error says which multiple to use.
    ``ps_servers`` > 0 plans ``ps`` with that many servers too; it is recommended only where the runtime runs it and
    it can win (``param_server.recommendable``). ``ep``: the expert-parallel degree to plan for a mixture of experts
    (None: every one that divides a node and the experts; 1: none). ``cp``: the context-parallel degree to plan for a
    transformer (None: every one its heads take with each tp within a node; 1: none). ``strategy``: with ``exact``,
    plan only that way of running it (``--layout zero3,cp=2``).
    """
    training = training or Training()
    world = cluster.world_size
    global_batch = training.global_for(world)
    training = replace(training, global_batch=global_batch)
    found = candidate_layouts(
        stats, cluster, tp, exact, training.stages_per_rank, ps_servers, ep, cp, strategy, training.schedule
    )
    why_not = [(lay, split_error(training, lay, world)) for lay in found[1:]]
    refused = [(lay, why) for lay, why in why_not if why is not None]
    if refused and len(refused) == len(found) - 1:
        raise ConfigError(
            refused[0][1]
            if exact is not None
            else f"--global-batch {global_batch} does not split evenly over the data-parallel replicas of "
            f"any layout of {world} GPUs; use a multiple of {world}, e.g. "
            f"{max(world, global_batch // world * world)}"
        )
    estimates = estimate_layouts(stats, cluster, training, found[0], [lay for lay, why in why_not if why is None])
    candidates = [
        e
        for e in (estimates if world == 1 or cluster.device.shared_by_ranks else estimates[1:])
        if recommendable(stats, cluster, e.layout)
    ]
    fitting = [f for e in candidates for f in _fitting(stats, e, training, cluster, estimates[0].samples_per_s)]
    left_out = [] if not refused else [unsplit_note(global_batch, world, [lay for lay, _ in refused])]
    left_out += [f"no {f} rows: the runtime refuses {f} on this model ({why})" for f, why in stats.refused.items()]
    plan = Plan(
        stats=stats,
        cluster=cluster,
        training=training,
        global_batch=global_batch,
        estimates=tuple(estimates),
        choice=None,
        reason="",
        suggestions=(),
        notes=tuple(left_out),
    )
    if not fitting:
        if exact is None:
            raise ConfigError(f"no strategy fits: {fits_nowhere(stats, cluster, training, candidates)}")
        return replace(
            plan,
            reason=f"the layout asked for ({exact.describe()}) fits in no way to run it: "
            f"{fits_nowhere(stats, cluster, training, candidates)}",
        )
    best = max(e.samples_per_s for e in fitting)
    choice = min(
        (e for e in fitting if e.samples_per_s >= (1 - TIE) * best),
        key=lambda e: (
            e.checkpointing,
            e.layout.cp > 1,
            e.layout.tp > 1,
            e.layout.ep > 1,
            STRATEGY_ORDER.index(e.layout.name),
            e.layout.zero,
        ),
    )
    return replace(
        plan,
        choice=choice,
        reason=(
            why_exact(choice, fitting, exact) if exact is not None else why_chosen(choice, estimates, fitting, cluster)
        ),
        suggestions=tuple(changes(stats, cluster, training, choice, estimates)),
        notes=(*plan_notes(stats, cluster, training, choice, estimates), *left_out),
    )


def _fitting(stats: ModelStats, e: Estimate, training: Training, cluster: Cluster, baseline: float) -> list[Estimate]:
    """``e`` if it fits; else its layout at the largest micro-batch that fits, without and with checkpointing."""
    if e.fits:
        return [e]
    out = []
    for setup in (training, replace(training, checkpointing=True)):
        b = largest_micro_batch(stats, e.layout, setup, cluster)
        if b >= 1:
            out.append(estimate(stats, e.layout, replace(setup, micro_batch=b), cluster, baseline))
    return out
