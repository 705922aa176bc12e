"""What a benchmark found: one row per configuration, the torch-ddp comparison, and the machine it ran on."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from .config import BenchConfig
from .machine import Machine
from .measure import TORCH_DDP, RankRecord


@dataclass(kw_only=True)
class Row:
    """One configuration: a strategy (or the hand-written DDP loop) at one world size and thread count."""

    label: str
    """How the table names it: the strategy, ``torch-ddp``, or ``single`` for one process."""
    world: int
    threads: int
    """Intra-op threads per rank."""
    replicas: int = 0
    """Data-parallel replicas (the world size, divided by a pipeline's depth; a parameter server's workers)."""
    servers: int = 0
    """Ranks that served instead of training (a parameter server's): the row's timings are the other ranks'."""
    global_batch: int = 0
    samples_per_s: float = 0.0
    step_ms: float = 0.0
    """Median step time of the slowest rank, data wait included."""
    step_p90_ms: float = 0.0
    speedup: float | None = None
    """Throughput over the world-1 run's."""
    efficiency: float | None = None
    """Speedup divided by the hardware used relative to the world-1 run (ranks x threads)."""
    comm_share: float | None = None
    """Share of the step spent waiting for gradient communication, or in a parameter server's pulls and pushes
    (None: not measurable for this strategy)."""
    data_share: float = 0.0
    """Share of the step spent drawing the next batch and moving it to the device."""
    imbalance: float | None = None
    """Slowest rank's local work over the ranks' mean, minus 1."""
    bytes_per_step: float | None = None
    """Per training rank and step: the bytes it sent plus those it received to keep the model in step (ddp: its
    gradient all-reduce, computed; ps: its messages' payloads, measured; None: the strategy does not count them)."""
    peak_mb: list[float] = field(default_factory=list)
    """Per rank: peak memory in MiB (see ``memory_kind``)."""
    memory_kind: str = ""
    oversubscribed: str | None = None
    """Why this configuration shares cores or GPUs, or None."""
    skipped: str | None = None
    """Why it did not run (the rest of the row is empty)."""
    rounds_ms: list[float] = field(default_factory=list)
    """Per round: the slowest rank's median step time."""
    all_to_all_ms: float | None = None
    """A mixture of experts: per step, the all-to-alls expert parallelism would do over these ranks, timed on them
    (the slowest rank's median over rounds; None: no experts, world 1 or a pipeline)."""
    all_to_all_bytes: float | None = None
    """… and the bytes each rank hands them per step."""

    @property
    def name(self) -> str:
        if self.label == "single" and self.world == 1:
            return f"1 proc x {self.threads} thread{'s' if self.threads > 1 else ''}"
        if self.servers:
            return f"{self.label} x{self.world} ({self.servers} server{'s' if self.servers > 1 else ''})"
        return f"{self.label} x{self.world}"


@dataclass(kw_only=True)
class Comparison:
    """paratrain's ddp against the hand-written DDP loop at one world size, timed in alternating blocks."""

    world: int
    overhead: float
    """Median over rounds of paratrain's step time over torch's (each round's medians, slowest rank)."""
    rounds: list[float]
    """Each round's ratio."""
    paratrain_ms: float
    torch_ms: float
    max_param_diff: float | None
    """Largest |difference| between the two models' parameters after the same steps (0: identical work)."""


@dataclass(kw_only=True)
class BenchResult:
    config: BenchConfig
    machine: Machine
    workload: str
    """The workload's one-line description."""
    rows: list[Row]
    comparisons: list[Comparison]
    notes: list[str]
    versions: dict[str, str]
    wall_s: float
    background_share: float = 0.0
    """Share of the machine's CPUs other processes used while the bench ran."""

    @property
    def fastest(self) -> Row | None:
        measured = [r for r in self.rows if r.skipped is None and r.label != TORCH_DDP]
        return max(measured, key=lambda r: r.samples_per_s) if measured else None


def summarise(label: str, world: int, threads: int, ranks: list[RankRecord]) -> Row:
    """One row from every rank's record of one run."""
    row = Row(label=label, world=world, threads=threads)
    first = ranks[0]
    if first.error is not None or not first.blocks:
        row.skipped = first.error or "no block was measured"
        return row
    row.replicas, row.memory_kind = first.replicas, first.memory_kind
    row.global_batch = first.replicas * first.replica_batch
    medians = [statistics.median(s for b in r.blocks for s in b.step_s) for r in ranks]
    p90s = [_quantile([s for b in r.blocks for s in b.step_s], 0.9) for r in ranks]
    row.step_ms, row.step_p90_ms = 1e3 * max(medians), 1e3 * max(p90s)
    row.samples_per_s = row.global_batch / max(medians)
    row.data_share = statistics.fmean(
        sum(s for b in r.blocks for s in b.data_s) / sum(s for b in r.blocks for s in b.step_s) for r in ranks
    )
    row.rounds_ms = [1e3 * max(statistics.median(r.blocks[i].step_s) for r in ranks) for i in range(len(first.blocks))]
    row.peak_mb = [max(b.peak_bytes for b in r.blocks) / 2**20 for r in ranks]
    row.bytes_per_step = bytes_per_step(ranks)
    if all(b.all_to_all_s is not None for r in ranks for b in r.blocks):
        row.all_to_all_ms = 1e3 * max(statistics.median(b.all_to_all_s for b in r.blocks) for r in ranks)  # type: ignore[misc]
        row.all_to_all_bytes = float(first.blocks[0].all_to_all_bytes or 0)
    if world == 1:
        row.comm_share, row.imbalance = 0.0, 0.0
    elif first.blocks[0].local_pass_s is not None:
        row.comm_share = statistics.fmean(_comm_share(r) for r in ranks)
        row.imbalance = statistics.median(_imbalance([r.blocks[i] for r in ranks]) for i in range(len(first.blocks)))
    elif all(b.moving_s is not None for r in ranks for b in r.blocks):  # timed where sent: a parameter server's
        row.comm_share = statistics.fmean(
            sum(b.moving_s for b in r.blocks) / sum(s for b in r.blocks for s in b.step_s) for r in ranks
        )
    return row


def bytes_per_step(ranks: list[RankRecord]) -> float | None:
    """The mean over ranks and blocks of the bytes a rank moved per timed step; None when any block was not
    counted."""
    moved = [(b.moved_bytes, len(b.step_s)) for r in ranks for b in r.blocks]
    if not moved or any(m is None for m, _ in moved):
        return None
    return statistics.fmean(m / n for m, n in moved)  # type: ignore[operator]


def _comm_share(record: RankRecord) -> float:
    """Median over rounds of (synced pass - local pass) / step, on one rank; noise below zero counts as zero."""
    return statistics.median(
        max(0.0, b.synced_pass_s - b.local_pass_s) / statistics.median(b.step_s)  # type: ignore[operator]
        for b in record.blocks
    )


def _imbalance(blocks: list) -> float:
    local = [b.local_pass_s for b in blocks]
    return max(local) / statistics.fmean(local) - 1.0


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def compare(world: int, ddp: list[RankRecord], torch_ddp: list[RankRecord]) -> Comparison | None:
    """paratrain's ddp over the hand-written loop, round by round, on the slowest rank."""
    if any(r.error for r in (*ddp, *torch_ddp)):
        return None
    rounds = min(len(ddp[0].blocks), len(torch_ddp[0].blocks))
    per_round = []
    for i in range(rounds):
        ours = max(statistics.median(r.blocks[i].step_s) for r in ddp)
        theirs = max(statistics.median(r.blocks[i].step_s) for r in torch_ddp)
        per_round.append(ours / theirs)
    diffs = [r.max_diff_vs_ddp for r in torch_ddp if r.max_diff_vs_ddp is not None]
    return Comparison(
        world=world,
        overhead=statistics.median(per_round),
        rounds=per_round,
        paratrain_ms=1e3 * max(statistics.median(s for b in r.blocks for s in b.step_s) for r in ddp),
        torch_ms=1e3 * max(statistics.median(s for b in r.blocks for s in b.step_s) for r in torch_ddp),
        max_param_diff=max(diffs) if diffs else None,
    )


def add_speedups(rows: list[Row]) -> None:
    """Speedup and efficiency of every row against the world-1 run at the ranks' thread count."""
    singles = [r for r in rows if r.world == 1 and r.label == "single" and r.skipped is None]
    if not singles:
        return
    base = min(singles, key=lambda r: r.threads)
    for row in rows:
        if row.skipped is None:
            row.speedup = row.samples_per_s / base.samples_per_s
            row.efficiency = row.speedup / (row.world * row.threads / base.threads)
