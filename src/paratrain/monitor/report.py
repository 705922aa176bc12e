"""What the monitor shows: the end-of-run table and the per-window CSV log."""

from __future__ import annotations

import csv
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..sizes import GIB, MIB
from .experts import ExpertLoad
from .rules import Finding, RankStats

COLUMNS = (
    "step",
    "rank",
    "peer",
    "steps",
    "step_ms",
    "busy_ms",
    "data_ms",
    "data_share",
    "compute_ms",
    "sync_ms",
    "peak_mem_bytes",
    "device_used_bytes",
)


def _bytes(n: float) -> str:
    if n < 0:
        return "n/a"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


@dataclass
class RunSummary:
    """The whole run per rank, and the warnings raised; ``table()`` is what ``Parallel.close()`` prints."""

    rows: list[RankStats]
    warnings: list[Finding] = field(default_factory=list)
    sync_point: str = "the sync point"
    memory: str = "peak RSS"
    """What ``peak_mem`` means here: ``"peak RSS"`` (CPU) or ``"peak alloc"`` (CUDA)."""
    every: int = 50
    accumulate: int = 1
    experts: list[ExpertLoad] = field(default_factory=list)
    """Each MoE layer's tokens per expert over the last window (empty for a dense model)."""
    skipped_steps: int = 0
    """Optimizer steps the numerics guard skipped."""

    def table(self) -> str:
        steps = max((r.steps for r in self.rows), default=0)
        micro = f" of {self.accumulate} micro-batches" if self.accumulate > 1 else ""
        lines = [
            f"paratrain monitor: {steps} optimizer steps{micro} per rank (medians over windows of "
            f"{self.every} steps); busy = time to reach {self.sync_point}"
        ]
        gpu = any(r.device_used >= 0 for r in self.rows)
        head = (
            f"{'rank':>4}  {'steps':>6}  {'step ms':>8}  {'data wait':>9}  {'compute ms':>10}  {'sync ms':>8}  "
            f"{self.memory:>10}" + (f"  {'GPU used':>10}" if gpu else "")
        )
        lines.append(head)
        for r in self.rows:
            lines.append(
                f"{r.rank:>4}  {r.steps:>6}  {r.step_ms:>8.1f}  {r.data_share:>9.1%}  {r.compute_ms:>10.1f}  "
                f"{r.sync_ms:>8.1f}  {_bytes(r.peak_mem):>10}" + (f"  {_bytes(r.device_used):>10}" if gpu else "")
            )
        lines.extend(_expert_lines(self.experts))
        if self.skipped_steps:
            lines.append(f"skipped by the numerics guard: {self.skipped_steps} optimizer step(s)")
        if self.warnings:
            lines.append(f"warnings ({len(self.warnings)}):")
            lines.extend(f"  - {w.message}" for w in self.warnings)
        else:
            lines.append(
                "warnings: none (no straggler, data loading keeps up"
                + (", GPU memory balanced" if gpu else "")
                + (", experts' routing balanced)" if self.experts else ")")
            )
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "sync_point": self.sync_point,
            "memory": self.memory,
            "every": self.every,
            "accumulate": self.accumulate,
            "ranks": [dict(zip(COLUMNS[1:], _row(r)[1:])) for r in self.rows],
            "warnings": [
                {"kind": w.kind, "rank": w.rank, "value": w.value, "message": w.message} for w in self.warnings
            ],
            "experts": [x.to_dict() for x in self.experts],
            "skipped_steps": self.skipped_steps,
        }


def _expert_lines(loads: Sequence[ExpertLoad]) -> list[str]:
    """The MoE layers' rows under the ranks' table: tokens per expert over the last window, all ranks'."""
    if not loads:
        return []
    width = max(len(x.layer) for x in loads)
    lines = [
        "tokens routed to each expert over the last window (every data-parallel rank; imbalance = busiest / mean):",
        f"{'MoE layer':<{width}}  {'imbalance':>9}  {'idle':>4}  tokens per expert",
    ]
    lines.extend(f"{x.layer:<{width}}  {x.imbalance:>9.2f}  {len(x.idle):>4}  {x.counts_text()}" for x in loads)
    return lines


def _row(r: RankStats, step: int = 0) -> list[float]:
    return [
        step,
        r.rank,
        r.peer,
        r.steps,
        r.step_ms,
        r.busy_ms,
        r.data_ms,
        r.data_share,
        r.compute_ms,
        r.sync_ms,
        r.peak_mem,
        r.device_used,
    ]


class CsvLog:
    """Appends one row per rank and window; writes the header when the file is new."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or os.path.getsize(self.path) == 0
        self._file = open(self.path, "a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(("time", *COLUMNS))

    def write(self, step: int, rows: Sequence[RankStats]) -> None:
        now = round(time.time(), 3)
        for r in rows:
            self._writer.writerow((now, *(round(v, 4) if isinstance(v, float) else v for v in _row(r, step))))
        self._file.flush()

    def close(self) -> None:
        self._file.close()
