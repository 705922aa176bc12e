"""Every strategy estimated for a model on a cluster, and the one to use, with the reason.

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

import math
from dataclasses import dataclass, replace

from ..dims import ParallelDims
from ..errors import ConfigError
from .context_parallel import cp_pairs, link_of as cp_link
from .hardware import GIB, Cluster
from .expert_parallel import ep_degrees, link_of as ep_link
from .layout import STRATEGY_ORDER, Layout, exact_layouts, layouts
from .memory import MemoryBreakdown, activation_mode, memory_per_rank
from .model_stats import ModelStats
from .param_server import Serving, serving
from .tensor_parallel import collective_bytes, collectives_per_micro_batch, tp_degrees
from .timing import StepTime, bubble_fraction, step_time
from .training import Batching, Training, batch_split_error, batching

TIE = 0.10
"""Throughputs within 10% count as equal: the simpler strategy is recommended. Predicted step times land within
about 20% of measured ones on CPU (benchmarks/RESULTS.md §3), so a smaller lead is not evidence enough to pay
for a strategy's extra machinery."""
TIGHT = 0.9
"""Above this share of device memory a plan is flagged: allocator fragmentation can push it over."""


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """One strategy's memory and time on the cluster."""

    layout: Layout
    batch: Batching
    memory: MemoryBreakdown
    time: StepTime
    capacity: float
    """Bytes one rank may use."""
    checkpointing: bool
    """Planned with activation checkpointing."""
    samples_per_s: float
    speedup: float
    """Throughput over one rank's ('single'), which trains the same global batch at the same micro-batch,
    accumulating it: every row then steps its optimizer once per global batch, so no row gains from stepping it
    less often than another."""
    efficiency: float
    """Speedup per device: per GPU, or per host when ranks share a CPU host."""
    serving: Serving | None = None
    """Parameter servers (``ps``): a worker's and a server's memory and the bytes of a step; ``memory`` is then the
    larger of the two."""

    @property
    def name(self) -> str:
        """The strategy, ``+tp`` when composed with tensor parallelism (``Layout.label``)."""
        return self.layout.label

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.capacity

    @property
    def tight(self) -> bool:
        return self.fits and self.memory.total > TIGHT * self.capacity

    @property
    def over(self) -> float:
        """Bytes more than a rank may use (0 when it fits)."""
        return max(0.0, self.memory.total - self.capacity)


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


def estimate(stats: ModelStats, layout: Layout, training: Training, cluster: Cluster,
             baseline_samples_per_s: float | None = None) -> Estimate:
    """Memory and time of one layout; ``baseline_samples_per_s`` is the single rank's, for the speedup.

    Parameter servers read no data: their workers take the share of the global batch as many data-parallel ranks
    would each (the per-GPU share), so a ``ps`` step trains workers/GPUs of it."""
    world = cluster.world_size
    if layout.servers:
        training = replace(training, global_batch=training.global_for(world) * layout.dp // layout.dims.dp)
    batch = batching(training, dp=layout.dp, pp=layout.pp, world_size=world)
    served = serving(stats, layout, batch, training, cluster) if layout.servers else None
    if served is not None:
        mem, t = max(served.worker, served.server, key=lambda m: m.total), served.time
    else:
        mem, t = memory_per_rank(stats, layout, batch, training, cluster), step_time(stats, layout, batch, training, cluster)
    sps = training.global_for(world) / t.step_s
    base = baseline_samples_per_s or sps
    devices = cluster.nodes if cluster.device.shared_by_ranks else layout.world_size
    return Estimate(layout=layout, batch=batch, memory=mem, time=t, checkpointing=training.checkpointing,
                    capacity=cluster.memory_bytes(cluster.ranks_per_node if layout.world_size > 1 else 1),
                    samples_per_s=sps, speedup=sps / base, efficiency=sps / base / devices, serving=served)


def estimate_all(stats: ModelStats, cluster: Cluster, training: Training, tp: int | None = None,
                 exact: ParallelDims | None = None, ps_servers: int = 0, ep: int | None = None,
                 cp: int | None = None) -> list[Estimate]:
    """One estimate per strategy at ``training``'s micro-batch; the first is the single-rank baseline.

    Where a strategy comes in several degree splits (hybrid's dp x pp, model_parallel's GPUs per process, the
    tensor-parallel degree), the fastest that fits is kept, or the least memory-hungry when none fits. ``tp``:
    the tensor-parallel degree to plan (``tensor_parallel.tp_degrees``: None every one that fits the model and a
    node, 1 none). ``exact``: plan only the layouts of these degrees (``layout.exact_layouts``). Layouts whose
    data-parallel replicas cannot share the global batch evenly (``training.batch_split_error``) are left out.
    ``ps_servers``: plan ``ps`` with that many servers too (0: not). ``ep``: the expert-parallel degree to plan
    (``expert_parallel.ep_degrees``: None every one that fits a mixture of experts and a node, 1 none). ``cp``: the
    context-parallel degree to plan (``context_parallel.cp_pairs``: None every one that fits the heads and a node
    with each tp, 1 none).
    """
    found = candidate_layouts(stats, cluster, tp, exact, training.stages_per_rank, ps_servers, ep, cp)
    world = cluster.world_size
    splits = [lay for lay in found[1:] if _split_error(training, lay, world) is None]
    return _estimates(stats, cluster, training, found[0], splits)


def _estimates(stats: ModelStats, cluster: Cluster, training: Training, single_layout: Layout,
               found: list[Layout]) -> list[Estimate]:
    """``estimate_all``'s estimates of layouts already enumerated and checked against the global batch; the single
    rank's trains the same global batch (``Estimate.speedup``)."""
    single = estimate(stats, single_layout, training, cluster)
    best: dict[str, Estimate] = {}
    for lay in found:
        e = estimate(stats, lay, training, cluster, single.samples_per_s)
        if lay.label not in best or _rank(e) > _rank(best[lay.label]):
            best[lay.label] = e
    return [single, *best.values()]


def candidate_layouts(stats: ModelStats, cluster: Cluster, tp: int | None = None,
                      exact: ParallelDims | None = None, virtual_stages: int = 1, ps_servers: int = 0,
                      ep: int | None = None, cp: int | None = None, strategy: str | None = None) -> list[Layout]:
    """The layouts a plan weighs, ``single`` first: every one the cluster can run (with ``ps_servers`` > 0 also
    ``ps``; a mixture of experts also with ``ep``; a transformer also with ``cp``), or ``exact``'s (only
    ``strategy``'s when named); with
    ``virtual_stages`` per rank (interleaved 1F1B) only pipelines whose p·v stages the model's units can fill."""
    units = len(stats.units)
    if exact is None:
        tps = tp_degrees(stats, cluster, tp)
        found = layouts(cluster, units, tps, ps_servers, ep_degrees(stats, cluster, ep),
                        cp_pairs(stats, cluster, tps, cp))
    else:
        tp_degrees(stats, cluster, exact.tp)  # a one-line error when the model's heads or the GPUs do not divide
        ep_degrees(stats, cluster, exact.ep)  # and when it has no experts, or they do not divide
        cp_pairs(stats, cluster, (exact.tp,), exact.cp)  # and when its heads do not take cp
        found = exact_layouts(cluster, units, exact, strategy)
        if exact.pp * virtual_stages > units:
            raise ConfigError(f"--schedule interleaved-1f1b with {virtual_stages} stages per rank cuts the model into "
                              f"{exact.pp * virtual_stages} stages but it has only {units} units to cut; use "
                              f"--virtual-stages {max(2, units // exact.pp)} or fewer, or fewer pipeline stages")
    return [lay for lay in found if lay.pp * virtual_stages <= units or lay.pp == 1]


def _split_error(training: Training, layout: Layout, world: int) -> str | None:
    """Why the global batch does not split over ``layout``'s data-parallel dimension (``batch_split_error``), or
    None: the runtime's (``Layout.dims``), whose ranks under ``ps`` take one per-GPU share each, servers
    included (``estimate``)."""
    return batch_split_error(training, dp=layout.dims.dp, pp=layout.pp, world_size=world)


def _rank(e: Estimate) -> tuple[bool, float]:
    return e.fits, e.samples_per_s if e.fits else -e.memory.total


def largest_micro_batch(stats: ModelStats, layout: Layout, training: Training, cluster: Cluster,
                        share: float = 1.0) -> int:
    """The largest per-GPU micro-batch <= the requested one whose plan uses at most ``share`` of memory (0: none).

    Memory grows with the micro-batch (activations), so a binary search finds it.
    """
    def ok(b: int) -> bool:
        e = estimate(stats, layout, replace(training, micro_batch=b), cluster)
        return e.memory.total <= share * e.capacity

    lo, hi = 0, training.micro_batch
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo


def recommend(stats: ModelStats, cluster: Cluster, training: Training | None = None, *,
              tp: int | None = None, exact: ParallelDims | None = None, ps_servers: int = 0,
              ep: int | None = None, cp: int | None = None, strategy: str | None = None) -> Plan:
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
    it can win (``_may_choose``). ``ep``: the expert-parallel degree to plan for a mixture of experts (None: every
    one that divides a node and the experts; 1: none). ``cp``: the context-parallel degree to plan for a
    transformer (None: every one its heads take with each tp within a node; 1: none). ``strategy``: with ``exact``,
    plan only that way of running it (``--layout zero3,cp=2``).
    """
    training = training or Training()
    world = cluster.world_size
    global_batch = training.global_for(world)
    training = replace(training, global_batch=global_batch)
    found = candidate_layouts(stats, cluster, tp, exact, training.stages_per_rank, ps_servers, ep, cp, strategy)
    why_not = [(lay, _split_error(training, lay, world)) for lay in found[1:]]
    refused = [(lay, why) for lay, why in why_not if why is not None]
    if refused and len(refused) == len(found) - 1:
        raise ConfigError(refused[0][1] if exact is not None else
                          f"--global-batch {global_batch} does not split evenly over the data-parallel replicas of "
                          f"any layout of {world} GPUs; use a multiple of {world}, e.g. "
                          f"{max(world, global_batch // world * world)}")
    estimates = _estimates(stats, cluster, training, found[0], [lay for lay, why in why_not if why is None])
    candidates = [e for e in (estimates if world == 1 or cluster.device.shared_by_ranks else estimates[1:])
                  if _may_choose(stats, cluster, e.layout)]
    fitting = [f for e in candidates for f in _fitting(stats, e, training, cluster, estimates[0].samples_per_s)]
    notes = [] if not refused else [
        f"--global-batch {global_batch} does not split evenly over {world} GPUs: layouts of "
        f"{', '.join(f'dp={d}' for d in sorted({lay.dims.dp for lay, _ in refused}))} data-parallel replicas are "
        "left out"]
    plan = Plan(stats=stats, cluster=cluster, training=training, global_batch=global_batch,
                estimates=tuple(estimates), choice=None, reason="", suggestions=(), notes=tuple(notes))
    if not fitting:
        if exact is None:
            raise ConfigError(f"no strategy fits: {_fits_nowhere(stats, cluster, training, candidates)}")
        return replace(plan, reason=f"the layout asked for ({exact.describe()}) fits in no way to run it: "
                                    f"{_fits_nowhere(stats, cluster, training, candidates)}")
    best = max(e.samples_per_s for e in fitting)
    choice = min((e for e in fitting if e.samples_per_s >= (1 - TIE) * best),
                 key=lambda e: (e.checkpointing, e.layout.cp > 1, e.layout.tp > 1, e.layout.ep > 1,
                                STRATEGY_ORDER.index(e.layout.name), e.layout.zero))
    return replace(plan, choice=choice, reason=(_exact_reason(choice, fitting, exact) if exact is not None
                                                else _reason(choice, estimates, fitting, cluster)),
                   suggestions=tuple(_changes(stats, cluster, training, choice, estimates)),
                   notes=(*_notes(stats, cluster, training, choice, estimates), *notes))


def _changes(stats: ModelStats, cluster: Cluster, training: Training, choice: Estimate,
             estimates: list[Estimate]) -> list[str]:
    """What to change to run ``choice`` as planned: checkpointing or a smaller micro-batch where the plan needed
    them to fit, then ``_suggestions``."""
    out = []
    if choice.checkpointing and not training.checkpointing:
        out.append("turn on activation checkpointing of every block (--checkpointing): one more forward pass per "
                   "step is the cheapest way to fit")
    as_asked = next(e for e in estimates if e.name == choice.name)
    if choice.batch.micro_batch < as_asked.batch.micro_batch:
        out.append(f"{choice.name} does not fit micro-batches of {as_asked.batch.micro_batch:g}: "
                   f"{_cut(choice.layout, choice.batch, cluster)}, for the same global batch "
                   f"{training.global_for(cluster.world_size)}")
    return out + _suggestions(stats, cluster, training, choice)


def _may_choose(stats: ModelStats, cluster: Cluster, layout: Layout) -> bool:
    """Whether ``layout`` may be recommended. Parameter servers only for a model with tables, on a CPU host: for a
    dense model synchronous ``ps`` computes what ddp does while every step moves the whole model through the
    servers (benchmarks/RESULTS.md §16: 0.49x ddp), and the runtime's messages are CPU tensors over gloo."""
    return not layout.servers or (bool(stats.tables) and cluster.device.shared_by_ranks)


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


def _fits_nowhere(stats: ModelStats, cluster: Cluster, training: Training, candidates: list[Estimate]) -> str:
    at_one = replace(training, micro_batch=1, checkpointing=True)
    least = min((estimate(stats, e.layout, at_one, cluster) for e in candidates), key=lambda e: e.memory.total)
    tries = []
    if not cluster.device.shared_by_ranks:
        more = next((c for c in (_grown(cluster, 2**k) for k in range(1, 13)) if c.world_size > cluster.world_size
                     and any(e.fits for e in estimate_all(stats, c, at_one)[1:])), None)
        if more is not None:
            tries.append(f"--gpus {more.ranks_per_node} --nodes {more.nodes}")
    if training.precision == "fp32":
        tries.append("--precision bf16-mixed")
    tries.append("a device with more memory (--gpu)")
    return (f"need {least.memory.total / GIB:.1f} GiB per GPU ({least.name} at micro-batch 1 with activation "
            f"checkpointing), have {least.capacity / GIB:.1f}; try {', '.join(tries)}")


def _grown(cluster: Cluster, ranks: int) -> Cluster:
    """``ranks`` ranks in nodes of at least 8 (or the cluster's node size when larger)."""
    per_node = min(ranks, max(8, cluster.ranks_per_node))
    return replace(cluster, ranks_per_node=per_node, nodes=math.ceil(ranks / per_node))


def _reason(choice: Estimate, estimates: list[Estimate], fitting: list[Estimate], cluster: Cluster) -> str:
    by_name = {e.name: e for e in estimates}
    mem = f"{choice.memory.total / GIB:.1f} of {choice.capacity / GIB:.1f} GiB per rank"
    if choice.layout.cp > 1:
        return _cp_reason(choice, fitting, cluster, mem)
    if choice.layout.tp > 1:
        return _tp_reason(choice, estimates, fitting, cluster, mem)
    if choice.layout.ep > 1:
        return _ep_reason(choice, fitting, cluster, mem)
    if choice.name == "single" and cluster.world_size > 1:
        return (f"one process using all cores is fastest: the {cluster.world_size} processes would share this "
                f"host's compute and add gradient traffic ({mem})")
    if choice.name in ("single", "ddp"):
        return f"{choice.name} fits ({mem}) and shards nothing, so it communicates least"
    ddp = by_name.get("ddp")
    if ddp is not None and not ddp.fits:
        return (f"ddp needs {ddp.memory.total / GIB:.1f} GiB per GPU, more than {ddp.capacity / GIB:.1f}; "
                f"{choice.name} is the fastest strategy that fits ({mem})")
    if ddp is not None:
        link = cluster.inter if cluster.nodes > 1 else cluster.intra
        why, saved = [], ddp.time.step_s - choice.time.step_s
        if ddp.time.exposed_comm_s - choice.time.exposed_comm_s >= saved / 4:
            why.append(f"ddp would spend {ddp.time.exposed_comm_s / ddp.time.step_s:.0%} of each step waiting on its "
                       f"gradient all-reduce over {link.name} ({link.bandwidth_gbs:g} GB/s)")
        if ddp.time.optimizer_s - choice.time.optimizer_s >= saved / 4:
            why.append(f"every ddp rank repeats the whole optimizer step ({1e3 * ddp.time.optimizer_s:.3g} ms), "
                       f"{choice.name} steps only its part ({1e3 * choice.time.optimizer_s:.3g} ms)")
        return (f"{choice.name} is {choice.samples_per_s / ddp.samples_per_s:.2f}x faster than ddp: "
                f"{' and '.join(why) or 'it communicates less'}; {choice.name} fits ({mem})")
    return f"{choice.name} is the fastest strategy that fits ({mem})"


def _exact_reason(choice: Estimate, fitting: list[Estimate], exact: ParallelDims) -> str:
    """The layout was asked for (``--layout``): say so, and which way of running its data parallelism won."""
    mem = f"{choice.memory.total / GIB:.1f} of {choice.capacity / GIB:.1f} GiB per rank"
    others = sorted({e.name for e in fitting} - {choice.name})
    rivals = (f"; of the ways to run it, {choice.name} beats {', '.join(others)} or ties and is simpler"
              if others else "")
    return f"the layout asked for ({exact.describe()}) fits as {choice.name} ({mem}){rivals}"


def _tp_reason(choice: Estimate, estimates: list[Estimate], fitting: list[Estimate], cluster: Cluster,
               mem: str) -> str:
    """Why a tensor-parallel layout: nothing without it fits, or it is more than ``TIE`` faster than all that do."""
    t, lay = choice.time, choice.layout
    link = cluster.link_for(lay.tp, 1)
    cost = (f"for {1e3 * t.tp_comm_s:.3g} ms of per-layer activation collectives per step over {link.name} "
            f"({link.bandwidth_gbs:g} GB/s, {t.tp_comm_s / t.step_s:.0%} of the step)")
    plain = [e for e in fitting if e.layout.tp == 1]
    if not plain:
        least = min((e for e in estimates[1:] if e.layout.tp == 1), key=lambda e: e.memory.total, default=None)
        need = (f"; the least, {least.name}, needs {least.memory.total / GIB:.1f} GiB at micro-batch "
                f"{least.batch.micro_batch:g}" if least is not None else "")
        return (f"no layout without tensor parallelism fits{need}; tp={lay.tp} splits every block's weights and "
                f"activations {lay.tp} ways ({mem}), {cost}")
    rival = max(plain, key=lambda e: e.samples_per_s)
    how = " (with activation checkpointing)" if rival.checkpointing and not choice.checkpointing else ""
    return (f"{choice.name} ({lay.describe()}) is {choice.samples_per_s / rival.samples_per_s:.2f}x faster than "
            f"{rival.name}{how}, the fastest without tensor parallelism: tp={lay.tp} splits each micro-batch's "
            f"compute and the weights it streams {lay.tp} ways, {cost}; it fits ({mem})")


def _ep_reason(choice: Estimate, fitting: list[Estimate], cluster: Cluster, mem: str) -> str:
    """Why an expert-parallel layout: nothing without it fits, or it is more than ``TIE`` faster than all that do."""
    t, lay = choice.time, choice.layout
    link = ep_link(cluster, lay)
    cost = (f"for {1e3 * t.ep_comm_s:.3g} ms of all-to-alls per step over {link.name} ({link.bandwidth_gbs:g} GB/s, "
            f"{t.ep_comm_s / t.step_s:.0%} of the step)")
    plain = [e for e in fitting if e.layout.ep == 1 and e.layout.tp == 1]
    if not plain:
        return (f"no layout without expert parallelism fits; ep={lay.ep} gives each rank 1/{lay.ep} of the experts "
                f"({mem}), {cost}")
    rival = max(plain, key=lambda e: e.samples_per_s)
    return (f"{choice.name} ({lay.describe()}) is {choice.samples_per_s / rival.samples_per_s:.2f}x faster than "
            f"{rival.name}: each rank holds, streams{' and gathers' if lay.zero >= 2 else ''} 1/{lay.ep} of the "
            f"experts, {cost}; it fits ({mem})")


def _cp_reason(choice: Estimate, fitting: list[Estimate], cluster: Cluster, mem: str) -> str:
    """Why a context-parallel layout: nothing without it fits as it does, or it is more than ``TIE`` faster."""
    t, lay = choice.time, choice.layout
    link = cp_link(cluster, lay.tp, lay.cp)
    cost = (f"for {1e3 * t.cp_comm_s:.3g} ms of all-to-alls around attention per step over {link.name} "
            f"({link.bandwidth_gbs:g} GB/s, {t.cp_comm_s / t.step_s:.0%} of the step)")
    plain = [e for e in fitting if e.layout.cp == 1]
    split = f"cp={lay.cp} gives each rank 1/{lay.cp} of every sequence and of its activations"
    if not plain:
        return f"no layout without context parallelism fits; {split} ({mem}), {cost}"
    rival = max(plain, key=lambda e: e.samples_per_s)
    how = " with activation checkpointing" if rival.checkpointing and not choice.checkpointing else ""
    return (f"{choice.name} ({lay.describe()}) is {choice.samples_per_s / rival.samples_per_s:.2f}x faster than "
            f"{rival.name}{how}, the fastest without context parallelism: {split}, {cost}; it fits ({mem})")


def _suggestions(stats: ModelStats, cluster: Cluster, training: Training, choice: Estimate) -> list[str]:
    out = []
    lay, m = choice.layout, choice.batch.micro_batches
    if lay.pp > 1:
        v = training.stages_per_rank
        bubble = bubble_fraction(lay.pp, m, v)
        if bubble > 0.2:
            better = 4 * lay.pp
            out.append(f"pipeline bubble {bubble:.0%} with {m} micro-batches: --micro-batches {better} brings it to "
                       f"{bubble_fraction(lay.pp, better, v):.0%} (micro-batch "
                       f"{choice.batch.micro_batch * m / better:g})")
    if choice.tight:
        setup = replace(training, micro_batch=max(1, math.floor(choice.batch.micro_batch)),
                        checkpointing=choice.checkpointing)
        b = largest_micro_batch(stats, lay, setup, cluster, share=0.8)
        if b >= 1:
            roomy = estimate(stats, lay, replace(setup, micro_batch=b), cluster).batch
            out.append(f"memory is tight ({choice.memory.total / choice.capacity:.0%}): "
                       f"{_cut(lay, roomy, cluster)} keeps the global batch and leaves 20% free")
    return out


def _cut(layout: Layout, batch: Batching, cluster: Cluster) -> str:
    """How to run ``batch``: a pipeline's micro-batches, or per-GPU batch and gradient accumulation."""
    if layout.pp > 1:
        return f"--batch {batch.micro_batch:g} --micro-batches {batch.micro_batches}"
    rank = "process" if cluster.device.shared_by_ranks else "GPU"
    if batch.micro_batches == 1:
        return f"--batch {batch.micro_batch:g} per {rank}"
    return (f"--batch {batch.micro_batch:g} per {rank} with {batch.micro_batches} accumulation steps, "
            f"Parallel(accumulate={batch.micro_batches})")


def _notes(stats: ModelStats, cluster: Cluster, training: Training, choice: Estimate,
           estimates: list[Estimate]) -> list[str]:
    if cluster.world_size == 1:
        return []
    return (_speed_notes(cluster, choice, estimates) + _tp_notes(stats, cluster, training, estimates)
            + _cp_notes(stats, estimates) + _ps_notes(stats, cluster, estimates))


def _cp_notes(stats: ModelStats, estimates: list[Estimate]) -> list[str]:
    """Which rows fit without context parallelism and which only with it, when cp was planned."""
    if all(e.layout.cp == 1 for e in estimates) or all(e.layout.cp > 1 for e in estimates[1:]):
        return []  # no cp planned, or only cp (an exact layout): nothing to compare
    plain = [e.name for e in estimates[1:] if e.fits and e.layout.cp == 1]
    split = [e.name for e in estimates if e.fits and e.layout.cp > 1]
    tokens = f"at {stats.cp.seq_len} tokens a sample, " if stats.cp is not None else ""
    return [f"context parallelism: {tokens}without it "
            + (f"{', '.join(plain)} fit{'s' if len(plain) == 1 else ''}" if plain else "no layout fits")
            + " as planned; with it " + (f"{', '.join(split)} fit{'s' if len(split) == 1 else ''}" if split
                                         else "none fits either")]


def _ps_notes(stats: ModelStats, cluster: Cluster, estimates: list[Estimate]) -> list[str]:
    """Why a ``ps`` row is there but not a candidate (``_may_choose``)."""
    ps = next((e for e in estimates if e.serving is not None), None)
    if ps is None or _may_choose(stats, cluster, ps.layout):
        return []
    if not stats.tables:
        return ["ps is planned, not recommended: the model has no embedding table for the servers to hold "
                "(an untied nn.Embedding/EmbeddingBag of >= 4M elements), so every step moves the whole model "
                "through the servers to compute what ddp computes"]
    return [f"ps is planned, not recommended: on {cluster.device.name} paratrain's servers keep to host memory and "
            f"its messages stage through the host over gloo (not measured on several GPUs); the row prices them over "
            f"{ps.serving.link.name}"]


def _tp_notes(stats: ModelStats, cluster: Cluster, training: Training, estimates: list[Estimate]) -> list[str]:
    """Tensor parallelism spanning nodes (slow), or not planned because the model's shape does not divide."""
    out = []
    wide = max(estimates, key=lambda e: e.layout.tp)
    if wide.layout.tp > cluster.ranks_per_node:
        size = collective_bytes(stats, activation_mode(training, wide.layout), wide.batch.micro_batch)[0]
        out.append(f"tp={wide.layout.tp} spans nodes: each micro-batch's "
                   f"{collectives_per_micro_batch(stats, training.checkpointing)} activation collectives (up to "
                   f"{size / 2**20:.3g} MiB each) wait on {cluster.inter.name} ({cluster.inter.bandwidth_gbs:g} GB/s)"
                   f" instead of {cluster.intra.name} ({cluster.intra.bandwidth_gbs:g} GB/s), and compute cannot "
                   f"hide them: keep tp <= {cluster.ranks_per_node}, within a node")
    if stats.tp is not None and cluster.ranks_per_node > 1 and all(e.layout.tp == 1 for e in estimates):
        why = stats.tp.why_not(2)
        if why is not None:
            out.append(f"tensor parallelism not planned: {why}")
    return out


def _speed_notes(cluster: Cluster, choice: Estimate, estimates: list[Estimate]) -> list[str]:
    if cluster.device.shared_by_ranks:
        n, cores = cluster.ranks_per_node, cluster.device.cores or cluster.ranks_per_node
        best = max(estimates[1:], key=lambda e: e.speedup)
        shared = f"the {n} processes split its {cores} cores" if n <= cores else \
            f"the {n} processes time-share its {cores} cores"
        verdict = ("more processes are slower than threads here: use them to test correctness, not for speed"
                   if best.speedup < 1 else "here more processes beat threads")
        return [f"CPU host: {shared} and its memory bandwidth, each repeats what is not sharded (the optimizer "
                f"step, the weights' streaming) and they add gradient traffic over gloo; the fastest, {best.name}, runs "
                f"at {best.speedup:.2f}x one process using every core as threads, so {verdict}"]
    if choice.speedup < 1:
        link = cluster.inter if cluster.nodes > 1 else cluster.intra
        return [f"even {choice.name} runs at {choice.speedup:.2f}x one GPU: {link.name} ({link.bandwidth_gbs:g} "
                "GB/s) is too slow for this model; use fewer nodes, a faster link, or a larger batch per step"]
    return []
