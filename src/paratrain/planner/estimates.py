"""Every strategy estimated for a model on a cluster: each layout's memory per rank and step time, its throughput and
speedup over one rank, and the layouts a plan weighs. ``recommend`` chooses among them; ``explain`` says why.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..dims import ParallelDims
from ..errors import ConfigError
from .context_parallel import cp_pairs
from .expert_parallel import ep_degrees
from .hardware import Cluster
from .layout import Layout, composes, exact_layouts, layouts
from .memory import MemoryBreakdown, memory_per_rank
from .model_stats import ModelStats
from .param_server import Serving, serving
from .tensor_parallel import tp_degrees
from .timing import StepTime, step_time
from .training import Batching, Training, batch_split_error, batching

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


def estimate(
    stats: ModelStats, layout: Layout, training: Training, cluster: Cluster, baseline_samples_per_s: float | None = None
) -> Estimate:
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
        mem = memory_per_rank(stats, layout, batch, training, cluster)
        t = step_time(stats, layout, batch, training, cluster)
    sps = training.global_for(world) / t.step_s
    base = baseline_samples_per_s or sps
    devices = cluster.nodes if cluster.device.shared_by_ranks else layout.world_size
    return Estimate(
        layout=layout,
        batch=batch,
        memory=mem,
        time=t,
        checkpointing=training.checkpointing,
        capacity=cluster.memory_bytes(cluster.ranks_per_node if layout.world_size > 1 else 1),
        samples_per_s=sps,
        speedup=sps / base,
        efficiency=sps / base / devices,
        serving=served,
    )


def estimate_all(
    stats: ModelStats,
    cluster: Cluster,
    training: Training,
    tp: int | None = None,
    exact: ParallelDims | None = None,
    ps_servers: int = 0,
    ep: int | None = None,
    cp: int | None = None,
) -> list[Estimate]:
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
    found = candidate_layouts(
        stats, cluster, tp, exact, training.stages_per_rank, ps_servers, ep, cp, schedule=training.schedule
    )
    world = cluster.world_size
    splits = [lay for lay in found[1:] if split_error(training, lay, world) is None]
    return estimate_layouts(stats, cluster, training, found[0], splits)


def estimate_layouts(
    stats: ModelStats, cluster: Cluster, training: Training, single_layout: Layout, found: list[Layout]
) -> list[Estimate]:
    """``estimate_all``'s estimates of layouts already enumerated and checked against the global batch; the single
    rank's trains the same global batch (``Estimate.speedup``)."""
    single = estimate(stats, single_layout, training, cluster)
    best: dict[str, Estimate] = {}
    for lay in found:
        e = estimate(stats, lay, training, cluster, single.samples_per_s)
        if lay.label not in best or _rank(e) > _rank(best[lay.label]):
            best[lay.label] = e
    return [single, *best.values()]


def candidate_layouts(
    stats: ModelStats,
    cluster: Cluster,
    tp: int | None = None,
    exact: ParallelDims | None = None,
    virtual_stages: int = 1,
    ps_servers: int = 0,
    ep: int | None = None,
    cp: int | None = None,
    strategy: str | None = None,
    schedule: str = "1f1b",
) -> list[Layout]:
    """The layouts a plan weighs, ``single`` first: every one the cluster can run (with ``ps_servers`` > 0 also
    ``ps``; a mixture of experts also with ``ep``; a transformer also with ``cp``), or ``exact``'s (only
    ``strategy``'s when named); with
    ``virtual_stages`` per rank (interleaved 1F1B) only pipelines whose p·v stages the model can be cut into
    (``ModelStats.stage_bound``: the runtime's cutter's, for a model the planner built)."""
    units, stages = len(stats.units), stats.stage_bound
    if exact is None:
        tps = tp_degrees(stats, cluster, tp)
        found = layouts(
            cluster, units, tps, ps_servers, ep_degrees(stats, cluster, ep), cp_pairs(stats, cluster, tps, cp)
        )
    else:
        tp_degrees(stats, cluster, exact.tp)  # a one-line error when the model's heads or the GPUs do not divide
        ep_degrees(stats, cluster, exact.ep)  # and when it has no experts, or they do not divide
        cp_pairs(stats, cluster, (exact.tp,), exact.cp)  # and when its heads do not take cp
        if exact.pp > 1 and stats.pipeline_refusal:
            raise ConfigError(stats.pipeline_refusal)
        if exact.pp > stages:
            raise ConfigError(
                f"--pp {exact.pp} cuts {stats.name} into {exact.pp} pipeline stages but paratrain's pipelines cut "
                f"it into {stages} at most; use --pp {stages} or fewer"
            )
        found = exact_layouts(cluster, units, exact, strategy)
        if exact.pp * virtual_stages > stages:
            raise ConfigError(
                f"--schedule interleaved-1f1b with {virtual_stages} stages per rank cuts the model into "
                f"{exact.pp * virtual_stages} stages but paratrain's pipelines cut it into {stages} at most; use "
                f"--virtual-stages {max(2, stages // exact.pp)} or fewer, or fewer pipeline stages"
            )
    fits = [lay for lay in found if lay.pp * virtual_stages <= stages or lay.pp == 1]
    return [lay for lay in fits if lay.pp == 1 or composes(lay, schedule)]  # ep beside a zero-bubble schedule


def split_error(training: Training, layout: Layout, world: int) -> str | None:
    """Why the global batch does not split over ``layout``'s data-parallel dimension (``batch_split_error``), or
    None: the runtime's (``Layout.dims``), whose ranks under ``ps`` take one per-GPU share each, servers
    included (``estimate``)."""
    return batch_split_error(training, dp=layout.dims.dp, pp=layout.pp, world_size=world)


def _rank(e: Estimate) -> tuple[bool, float]:
    return e.fits, e.samples_per_s if e.fits else -e.memory.total


def largest_micro_batch(
    stats: ModelStats, layout: Layout, training: Training, cluster: Cluster, share: float = 1.0
) -> int:
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
