"""The monitor's rules: pure functions over the per-rank figures of one window.

They take the gathered :class:`RankStats` of every rank and return :class:`Finding`s; :class:`Persistence`
turns findings into warnings once they hold for several windows in a row. No process group, no clock: the
rules are tested on made-up numbers.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import astuple, dataclass

from ..sizes import GIB
from .config import MonitorConfig


@dataclass(frozen=True)
class RankStats:
    """One rank's figures over a window (medians over its optimizer steps) or over the whole run."""

    rank: int
    peer: int
    """Ranks with the same peer id do the same work and are compared (a pipeline's stage; 0 otherwise)."""
    steps: int
    """Optimizer steps measured."""
    step_ms: float
    """Wall time from one optimizer step's gradient sync to the next (equal on all ranks, by construction)."""
    busy_ms: float
    """Time from the previous sync until this rank reached the next one: data wait + its own compute."""
    data_ms: float
    """Time spent in the prepared loaders' ``__next__`` per step."""
    peak_mem: float
    """Bytes: peak allocated by this process on CUDA (``max_memory_allocated``), peak RSS on CPU; -1: unknown."""
    device_used: float = -1.0
    """Bytes in use on this rank's GPU by every process (what nvidia-smi shows), peak over samples; -1: no GPU."""
    samples: float = 0.0
    """Samples its prepared loaders yielded per step (a batch's first dimension; 0: not a tensor batch)."""
    tokens: float = 0.0
    """Tokens its prepared loaders yielded per step (the elements of a 2-D integer batch of token ids; else 0)."""

    @property
    def compute_ms(self) -> float:
        return max(self.busy_ms - self.data_ms, 0.0)

    @property
    def sync_ms(self) -> float:
        """Time after reaching the sync point: communication plus waiting for slower ranks."""
        return max(self.step_ms - self.busy_ms, 0.0)

    @property
    def data_share(self) -> float:
        return self.data_ms / self.step_ms if self.step_ms > 0 else 0.0

    def to_list(self) -> list[float]:
        return [float(v) for v in astuple(self)]

    @classmethod
    def from_list(cls, values: Sequence[float]) -> RankStats:
        rank, peer, steps, *rest = values
        return cls(int(rank), int(peer), int(steps), *(float(v) for v in rest))


@dataclass(frozen=True)
class Finding:
    """One condition seen in one window."""

    kind: str
    """``"straggler"``, ``"data"``, ``"memory"`` or ``"routing"`` (a mixture of experts' collapse, :mod:`.experts`)."""
    rank: int
    """The rank it is about (the slowest / most loaded one; -1: the whole job)."""
    value: float
    """straggler: its time to the sync point over its peers' median; data: the share of the step; memory: the
    least-used GPU's memory over the most-used one's; routing: the worst layer's busiest expert over the mean."""
    message: str
    """One line: which rank, the numbers, the fix."""

    @property
    def key(self) -> str:
        """What persistence is counted on: each straggler on its own, data and memory once for the job."""
        return f"{self.kind}:{self.rank}" if self.kind == "straggler" else self.kind


def _peer_groups(stats: Sequence[RankStats]) -> list[list[RankStats]]:
    groups: dict[int, list[RankStats]] = {}
    for s in stats:
        if s.steps > 0:
            groups.setdefault(s.peer, []).append(s)
    return [g for g in groups.values() if len(g) > 1]


def find_stragglers(
    stats: Sequence[RankStats], config: MonitorConfig, sync_point: str = "the sync point"
) -> list[Finding]:
    """Ranks that reach the sync point persistently later than their peers.

    The gradient all-reduce makes every rank's wall step time equal, so ranks are compared on ``busy_ms``,
    the part of the step before they start waiting for the others. A rank is compared with the median of
    the *other* ranks, so in a pair the slower one is named and the faster one is not.
    """
    found = []
    for group in _peer_groups(stats):
        for s in group:
            ref = statistics.median(o.busy_ms for o in group if o.rank != s.rank)
            late = s.busy_ms - ref
            if late <= 0 or late < config.straggler_threshold * ref or late < config.straggler_min_cost * s.step_ms:
                continue
            ratio = s.busy_ms / ref if ref > 0 else float("inf")
            found.append(
                Finding(
                    "straggler",
                    s.rank,
                    ratio,
                    (
                        f"rank {s.rank} is a straggler: it reaches {sync_point} {late:.1f} ms after its peers "
                        f"({s.busy_ms:.1f} ms vs a median of {ref:.1f} ms, {ratio:.2f}x), so the others wait "
                        f"{late / s.step_ms:.0%} of every {s.step_ms:.1f} ms step for it; look for what differs on "
                        "that rank: other load on its host, its GPU's clocks and temperature (nvidia-smi -q -d "
                        "PERFORMANCE), its data shard"
                    ),
                )
            )
    return found


def find_data_stalls(stats: Sequence[RankStats], config: MonitorConfig, advice: str = "") -> list[Finding]:
    """One finding (about the worst rank) when any rank waits for data ``data_threshold`` of the step or more."""
    slow = [s for s in stats if s.steps > 0 and s.data_share >= config.data_threshold]
    if not slow:
        return []
    worst = max(slow, key=lambda s: s.data_share)
    who = (
        f"rank {worst.rank} waits"
        if len(slow) == 1
        else f"{len(slow)} of {len(stats)} ranks wait (worst: rank {worst.rank})"
    )
    return [
        Finding(
            "data",
            worst.rank,
            worst.data_share,
            (
                f"{who} for the next batch {worst.data_ms:.1f} ms of every {worst.step_ms:.1f} ms step "
                f"({worst.data_share:.0%}): the DataLoader cannot keep up; "
                + (advice or "load faster (more DataLoader workers, cheaper __getitem__)")
            ),
        )
    ]


def find_memory_imbalance(stats: Sequence[RankStats], config: MonitorConfig) -> list[Finding]:
    """The most and least loaded GPUs of a peer group, when they differ by ``memory_threshold`` or more."""
    found = []
    for group in _peer_groups([s for s in stats if s.device_used >= 0]):
        hi = max(group, key=lambda s: s.device_used)
        lo = min(group, key=lambda s: s.device_used)
        gap = hi.device_used - lo.device_used
        if hi.device_used <= 0 or gap < config.memory_threshold * hi.device_used or gap < config.memory_min_gib * GIB:
            continue
        own = (
            f"; its own tensors peaked at {hi.peak_mem / GIB:.1f} GiB, the rest belongs to other processes or "
            "CUDA contexts on that GPU"
            if 0 <= hi.peak_mem < hi.device_used - config.memory_min_gib * GIB
            else ""
        )
        found.append(
            Finding(
                "memory",
                hi.rank,
                lo.device_used / hi.device_used,
                (
                    f"GPU memory is unbalanced: rank {hi.rank}'s GPU holds {hi.device_used / GIB:.1f} GiB, rank "
                    f"{lo.rank}'s {lo.device_used / GIB:.1f} GiB ({gap / hi.device_used:.0%} less){own}; usual "
                    "causes: every rank touching cuda:0 (call torch.cuda.set_device(local_rank) first, "
                    "torch.load(..., map_location=par.device)), rank-0-only work (evaluation, logging, full state "
                    "dicts), uneven shards"
                ),
            )
        )
    return found


def find_all(
    stats: Sequence[RankStats], config: MonitorConfig, *, sync_point: str = "the sync point", data_advice: str = ""
) -> list[Finding]:
    """Every rule over one window."""
    return [
        *find_stragglers(stats, config, sync_point),
        *find_data_stalls(stats, config, data_advice),
        *find_memory_imbalance(stats, config),
    ]


class Persistence:
    """Reports a condition once, when it has held for ``persist`` consecutive windows; again only after it
    has cleared for a window and come back."""

    def __init__(self, persist: int) -> None:
        self.persist = persist
        self._runs: dict[str, int] = {}

    def update(self, findings: Sequence[Finding]) -> list[Finding]:
        current = {f.key: f for f in findings}
        self._runs = {key: self._runs.get(key, 0) + 1 for key in current}
        return [f for key, f in current.items() if self._runs[key] == self.persist]
