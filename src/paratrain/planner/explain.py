"""What a plan says in words: why its choice (``why_chosen``, ``why_exact``), what to change to run it
(``changes``), the notes beside it (``plan_notes``), and why nothing fits (``fits_nowhere``). The choosing is
``recommend``'s; these read its estimates and only size a suggestion (a micro-batch that leaves memory free, a
cluster that fits).
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..dims import ParallelDims
from .context_parallel import link_of as cp_link
from .estimates import Estimate, estimate, estimate_all, largest_micro_batch
from .expert_parallel import link_of as ep_link
from .hardware import GIB, Cluster
from .layout import Layout
from .memory import activation_mode
from .model_stats import ModelStats
from .param_server import recommendable
from .tensor_parallel import collective_bytes, collectives_per_micro_batch
from .timing import bubble_fraction
from .training import Batching, Training


def unsplit_note(global_batch: int, world: int, refused: list[Layout]) -> str:
    """The note on the layouts left out because the global batch does not split over their replicas."""
    return (
        f"--global-batch {global_batch} does not split evenly over {world} GPUs: layouts of "
        f"{', '.join(f'dp={d}' for d in sorted({lay.dims.dp for lay in refused}))} data-parallel replicas are "
        "left out"
    )


def why_chosen(choice: Estimate, estimates: list[Estimate], fitting: list[Estimate], cluster: Cluster) -> str:
    """Why ``choice``: what it wins over ddp (or the fastest layout without its tp, ep or cp) and by how much."""
    by_name = {e.name: e for e in estimates}
    mem = f"{choice.memory.total / GIB:.1f} of {choice.capacity / GIB:.1f} GiB per rank"
    if choice.layout.cp > 1:
        return _cp_reason(choice, fitting, cluster, mem)
    if choice.layout.tp > 1:
        return _tp_reason(choice, estimates, fitting, cluster, mem)
    if choice.layout.ep > 1:
        return _ep_reason(choice, fitting, cluster, mem)
    if choice.name == "single" and cluster.world_size > 1:
        return (
            f"one process using all cores is fastest: the {cluster.world_size} processes would share this "
            f"host's compute and add gradient traffic ({mem})"
        )
    if choice.name in ("single", "ddp"):
        return f"{choice.name} fits ({mem}) and shards nothing, so it communicates least"
    ddp = by_name.get("ddp")
    if ddp is not None and not ddp.fits:
        return (
            f"ddp needs {ddp.memory.total / GIB:.1f} GiB per GPU, more than {ddp.capacity / GIB:.1f}; "
            f"{choice.name} is the fastest strategy that fits ({mem})"
        )
    if ddp is not None:
        link = cluster.inter if cluster.nodes > 1 else cluster.intra
        why, saved = [], ddp.time.step_s - choice.time.step_s
        if ddp.time.exposed_comm_s - choice.time.exposed_comm_s >= saved / 4:
            why.append(
                f"ddp would spend {ddp.time.exposed_comm_s / ddp.time.step_s:.0%} of each step waiting on its "
                f"gradient all-reduce over {link.name} ({link.bandwidth_gbs:g} GB/s)"
            )
        if ddp.time.optimizer_s - choice.time.optimizer_s >= saved / 4:
            why.append(
                f"every ddp rank repeats the whole optimizer step ({1e3 * ddp.time.optimizer_s:.3g} ms), "
                f"{choice.name} steps only its part ({1e3 * choice.time.optimizer_s:.3g} ms)"
            )
        return (
            f"{choice.name} is {choice.samples_per_s / ddp.samples_per_s:.2f}x faster than ddp: "
            f"{' and '.join(why) or 'it communicates less'}; {choice.name} fits ({mem})"
        )
    return f"{choice.name} is the fastest strategy that fits ({mem})"


def why_exact(choice: Estimate, fitting: list[Estimate], exact: ParallelDims) -> str:
    """The layout was asked for (``--layout``): say so, and which way of running its data parallelism won."""
    mem = f"{choice.memory.total / GIB:.1f} of {choice.capacity / GIB:.1f} GiB per rank"
    others = sorted({e.name for e in fitting} - {choice.name})
    rivals = (
        f"; of the ways to run it, {choice.name} beats {', '.join(others)} or ties and is simpler" if others else ""
    )
    return f"the layout asked for ({exact.describe()}) fits as {choice.name} ({mem}){rivals}"


def _tp_reason(choice: Estimate, estimates: list[Estimate], fitting: list[Estimate], cluster: Cluster, mem: str) -> str:
    """Why a tensor-parallel layout: nothing without it fits, or it is more than ``TIE`` faster than all that do."""
    t, lay = choice.time, choice.layout
    link = cluster.link_for(lay.tp, 1)
    cost = (
        f"for {1e3 * t.tp_comm_s:.3g} ms of per-layer activation collectives per step over {link.name} "
        f"({link.bandwidth_gbs:g} GB/s, {t.tp_comm_s / t.step_s:.0%} of the step)"
    )
    plain = [e for e in fitting if e.layout.tp == 1]
    if not plain:
        least = min((e for e in estimates[1:] if e.layout.tp == 1), key=lambda e: e.memory.total, default=None)
        need = (
            f"; the least, {least.name}, needs {least.memory.total / GIB:.1f} GiB at micro-batch "
            f"{least.batch.micro_batch:g}"
            if least is not None
            else ""
        )
        return (
            f"no layout without tensor parallelism fits{need}; tp={lay.tp} splits every block's weights and "
            f"activations {lay.tp} ways ({mem}), {cost}"
        )
    rival = max(plain, key=lambda e: e.samples_per_s)
    how = " (with activation checkpointing)" if rival.checkpointing and not choice.checkpointing else ""
    return (
        f"{choice.name} ({lay.describe()}) is {choice.samples_per_s / rival.samples_per_s:.2f}x faster than "
        f"{rival.name}{how}, the fastest without tensor parallelism: tp={lay.tp} splits each micro-batch's "
        f"compute and the weights it streams {lay.tp} ways, {cost}; it fits ({mem})"
    )


def _ep_reason(choice: Estimate, fitting: list[Estimate], cluster: Cluster, mem: str) -> str:
    """Why an expert-parallel layout: nothing without it fits, or it is more than ``TIE`` faster than all that do."""
    t, lay = choice.time, choice.layout
    link = ep_link(cluster, lay)
    cost = (
        f"for {1e3 * t.ep_comm_s:.3g} ms of all-to-alls per step over {link.name} ({link.bandwidth_gbs:g} GB/s, "
        f"{t.ep_comm_s / t.step_s:.0%} of the step)"
    )
    plain = [e for e in fitting if e.layout.ep == 1 and e.layout.tp == 1]
    if not plain:
        return (
            f"no layout without expert parallelism fits; ep={lay.ep} gives each rank 1/{lay.ep} of the experts "
            f"({mem}), {cost}"
        )
    rival = max(plain, key=lambda e: e.samples_per_s)
    return (
        f"{choice.name} ({lay.describe()}) is {choice.samples_per_s / rival.samples_per_s:.2f}x faster than "
        f"{rival.name}: each rank holds, streams{' and gathers' if lay.zero >= 2 else ''} 1/{lay.ep} of the "
        f"experts, {cost}; it fits ({mem})"
    )


def _cp_reason(choice: Estimate, fitting: list[Estimate], cluster: Cluster, mem: str) -> str:
    """Why a context-parallel layout: nothing without it fits as it does, or it is more than ``TIE`` faster."""
    t, lay = choice.time, choice.layout
    link = cp_link(cluster, lay.tp, lay.cp)
    cost = (
        f"for {1e3 * t.cp_comm_s:.3g} ms of exchanges around attention per step over {link.name} "
        f"({link.bandwidth_gbs:g} GB/s, {t.cp_comm_s / t.step_s:.0%} of the step)"
    )
    plain = [e for e in fitting if e.layout.cp == 1]
    split = f"cp={lay.cp} gives each rank 1/{lay.cp} of every sequence and of its activations"
    if not plain:
        return f"no layout without context parallelism fits; {split} ({mem}), {cost}"
    rival = max(plain, key=lambda e: e.samples_per_s)
    how = " with activation checkpointing" if rival.checkpointing and not choice.checkpointing else ""
    return (
        f"{choice.name} ({lay.describe()}) is {choice.samples_per_s / rival.samples_per_s:.2f}x faster than "
        f"{rival.name}{how}, the fastest without context parallelism: {split}, {cost}; it fits ({mem})"
    )


def changes(
    stats: ModelStats, cluster: Cluster, training: Training, choice: Estimate, estimates: list[Estimate]
) -> list[str]:
    """What to change to run ``choice`` as planned: checkpointing or a smaller micro-batch where the plan needed
    them to fit, then ``_suggestions``."""
    out = []
    if choice.checkpointing and not training.checkpointing:
        out.append(
            "turn on activation checkpointing of every block (--checkpointing): one more forward pass per "
            "step is the cheapest way to fit"
        )
    as_asked = next(e for e in estimates if e.name == choice.name)
    if choice.batch.micro_batch < as_asked.batch.micro_batch:
        out.append(
            f"{choice.name} does not fit micro-batches of {as_asked.batch.micro_batch:g}: "
            f"{_cut(choice.layout, choice.batch, cluster)}, for the same global batch "
            f"{training.global_for(cluster.world_size)}"
        )
    return out + _suggestions(stats, cluster, training, choice)


def _suggestions(stats: ModelStats, cluster: Cluster, training: Training, choice: Estimate) -> list[str]:
    """More micro-batches where the pipeline bubble is over 20%; a smaller micro-batch where memory is tight."""
    out = []
    lay, m = choice.layout, choice.batch.micro_batches
    if lay.pp > 1:
        v = training.stages_per_rank
        bubble = bubble_fraction(lay.pp, m, v, training.schedule)
        if bubble > 0.2:
            better = 4 * lay.pp
            out.append(
                f"pipeline bubble {bubble:.0%} with {m} micro-batches: --micro-batches {better} brings it to "
                f"{bubble_fraction(lay.pp, better, v, training.schedule):.0%} (micro-batch "
                f"{choice.batch.micro_batch * m / better:g})"
            )
    if choice.tight:
        setup = replace(
            training, micro_batch=max(1, math.floor(choice.batch.micro_batch)), checkpointing=choice.checkpointing
        )
        b = largest_micro_batch(stats, lay, setup, cluster, share=0.8)
        if b >= 1:
            roomy = estimate(stats, lay, replace(setup, micro_batch=b), cluster).batch
            out.append(
                f"memory is tight ({choice.memory.total / choice.capacity:.0%}): "
                f"{_cut(lay, roomy, cluster)} keeps the global batch and leaves 20% free"
            )
    return out


def _cut(layout: Layout, batch: Batching, cluster: Cluster) -> str:
    """How to run ``batch``: a pipeline's micro-batches, or per-GPU batch and gradient accumulation."""
    if layout.pp > 1:
        return f"--batch {batch.micro_batch:g} --micro-batches {batch.micro_batches}"
    rank = "process" if cluster.device.shared_by_ranks else "GPU"
    if batch.micro_batches == 1:
        return f"--batch {batch.micro_batch:g} per {rank}"
    return (
        f"--batch {batch.micro_batch:g} per {rank} with {batch.micro_batches} accumulation steps, "
        f"Parallel(accumulate={batch.micro_batches})"
    )


def plan_notes(
    stats: ModelStats, cluster: Cluster, training: Training, choice: Estimate, estimates: list[Estimate]
) -> list[str]:
    """What the rows beside the choice say about speed, tp, cp and ps, and why pipelines are missing (nothing on one
    rank)."""
    if cluster.world_size == 1:
        return []
    return (
        _speed_notes(cluster, choice, estimates)
        + _tp_notes(stats, cluster, training, estimates)
        + _cp_notes(stats, estimates)
        + _ps_notes(stats, cluster, estimates)
        + ([f"no pipeline or hybrid rows: {stats.pipeline_refusal}"] if stats.pipeline_refusal else [])
    )


def _cp_notes(stats: ModelStats, estimates: list[Estimate]) -> list[str]:
    """Which rows fit without context parallelism and which only with it, when cp was planned."""
    if all(e.layout.cp == 1 for e in estimates) or all(e.layout.cp > 1 for e in estimates[1:]):
        return []  # no cp planned, or only cp (an exact layout): nothing to compare
    plain = [e.name for e in estimates[1:] if e.fits and e.layout.cp == 1]
    split = [e.name for e in estimates if e.fits and e.layout.cp > 1]
    tokens = f"at {stats.cp.seq_len} tokens a sample, " if stats.cp is not None else ""
    return [
        f"context parallelism: {tokens}without it "
        + (f"{', '.join(plain)} fit{'s' if len(plain) == 1 else ''}" if plain else "no layout fits")
        + " as planned; with it "
        + (f"{', '.join(split)} fit{'s' if len(split) == 1 else ''}" if split else "none fits either")
    ]


def _ps_notes(stats: ModelStats, cluster: Cluster, estimates: list[Estimate]) -> list[str]:
    """Why a ``ps`` row is there but not a candidate (``param_server.recommendable``)."""
    ps = next((e for e in estimates if e.serving is not None), None)
    if ps is None or recommendable(stats, cluster, ps.layout):
        return []
    if not stats.tables:
        return [
            "ps is planned, not recommended: the model has no embedding table for the servers to hold "
            "(an untied nn.Embedding/EmbeddingBag of >= 4M elements), so every step moves the whole model "
            "through the servers to compute what ddp computes"
        ]
    return [
        f"ps is planned, not recommended: on {cluster.device.name} paratrain's servers keep to host memory and "
        f"its messages stage through the host over gloo (not measured on several GPUs); the row prices them over "
        f"{ps.serving.link.name}"
    ]


def _tp_notes(stats: ModelStats, cluster: Cluster, training: Training, estimates: list[Estimate]) -> list[str]:
    """Tensor parallelism spanning nodes (slow), or not planned because the model's shape does not divide."""
    out = []
    wide = max(estimates, key=lambda e: e.layout.tp)
    if wide.layout.tp > cluster.ranks_per_node:
        size = collective_bytes(stats, activation_mode(training, wide.layout), wide.batch.micro_batch)[0]
        out.append(
            f"tp={wide.layout.tp} spans nodes: each micro-batch's "
            f"{collectives_per_micro_batch(stats, training.checkpointing)} activation collectives (up to "
            f"{size / 2**20:.3g} MiB each) wait on {cluster.inter.name} ({cluster.inter.bandwidth_gbs:g} GB/s)"
            f" instead of {cluster.intra.name} ({cluster.intra.bandwidth_gbs:g} GB/s), and compute cannot "
            f"hide them: keep tp <= {cluster.ranks_per_node}, within a node"
        )
    if stats.tp is not None and cluster.ranks_per_node > 1 and all(e.layout.tp == 1 for e in estimates):
        why = stats.tp.why_not(2)
        if why is not None:
            out.append(f"tensor parallelism not planned: {why}")
    return out


def _speed_notes(cluster: Cluster, choice: Estimate, estimates: list[Estimate]) -> list[str]:
    """Processes sharing a CPU host against threads, or a choice slower than one GPU."""
    if cluster.device.shared_by_ranks:
        n, cores = cluster.ranks_per_node, cluster.device.cores or cluster.ranks_per_node
        best = max(estimates[1:], key=lambda e: e.speedup)
        shared = (
            f"the {n} processes split its {cores} cores"
            if n <= cores
            else f"the {n} processes time-share its {cores} cores"
        )
        verdict = (
            "more processes are slower than threads here: use them to test correctness, not for speed"
            if best.speedup < 1
            else "here more processes beat threads"
        )
        return [
            f"CPU host: {shared} and its memory bandwidth, each repeats what is not sharded (the optimizer "
            f"step, the weights' streaming) and they add gradient traffic over gloo; the fastest, {best.name}, "
            f"runs at {best.speedup:.2f}x one process using every core as threads, so {verdict}"
        ]
    if choice.speedup < 1:
        link = cluster.inter if cluster.nodes > 1 else cluster.intra
        return [
            f"even {choice.name} runs at {choice.speedup:.2f}x one GPU: {link.name} ({link.bandwidth_gbs:g} "
            "GB/s) is too slow for this model; use fewer nodes, a faster link, or a larger batch per step"
        ]
    return []


def fits_nowhere(stats: ModelStats, cluster: Cluster, training: Training, candidates: list[Estimate]) -> str:
    """How far the least hungry candidate is from fitting, and what to try: more GPUs that would fit, bf16, a
    larger device."""
    at_one = replace(training, micro_batch=1, checkpointing=True)
    least = min((estimate(stats, e.layout, at_one, cluster) for e in candidates), key=lambda e: e.memory.total)
    tries = []
    if not cluster.device.shared_by_ranks:
        more = next(
            (
                c
                for c in (_grown(cluster, 2**k) for k in range(1, 13))
                if c.world_size > cluster.world_size and any(e.fits for e in estimate_all(stats, c, at_one)[1:])
            ),
            None,
        )
        if more is not None:
            tries.append(f"--gpus {more.ranks_per_node} --nodes {more.nodes}")
    if training.precision == "fp32":
        tries.append("--precision bf16-mixed")
    tries.append("a device with more memory (--gpu)")
    return (
        f"need {least.memory.total / GIB:.1f} GiB per GPU ({least.name} at micro-batch 1 with activation "
        f"checkpointing), have {least.capacity / GIB:.1f}; try {', '.join(tries)}"
    )


def _grown(cluster: Cluster, ranks: int) -> Cluster:
    """``ranks`` ranks in nodes of at least 8 (or the cluster's node size when larger)."""
    per_node = min(ranks, max(8, cluster.ranks_per_node))
    return replace(cluster, ranks_per_node=per_node, nodes=math.ceil(ranks / per_node))
