"""A benchmark's result as JSON (everything), CSV (one line per configuration) and a PNG plot."""

from __future__ import annotations

import csv
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from .result import BenchResult

CSV_FIELDS = (
    "name",
    "label",
    "world",
    "threads",
    "replicas",
    "servers",
    "global_batch",
    "samples_per_s",
    "step_ms",
    "step_p90_ms",
    "speedup",
    "efficiency",
    "comm_share",
    "data_share",
    "imbalance",
    "bytes_per_step",
    "all_to_all_ms",
    "all_to_all_bytes",
    "peak_mb_max",
    "memory_kind",
    "oversubscribed",
    "skipped",
)


def to_json(result: BenchResult) -> dict[str, Any]:
    rows = [{"name": r.name, **asdict(r)} for r in result.rows]
    return {
        "config": asdict(result.config),
        "machine": asdict(result.machine),
        "workload": result.workload,
        "versions": result.versions,
        "rows": rows,
        "comparisons": [asdict(c) for c in result.comparisons],
        "fastest": result.fastest.name if result.fastest else None,
        "notes": result.notes,
        "wall_s": result.wall_s,
        "background_share": result.background_share,
    }


def write_json(result: BenchResult, path: Path) -> None:
    path.write_text(json.dumps(to_json(result), indent=1) + "\n")


def write_csv(result: BenchResult, path: Path) -> None:
    with path.open("w", newline="") as f:
        out = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        out.writeheader()
        for r in result.rows:
            values = {"name": r.name, "peak_mb_max": max(r.peak_mb, default=None), **asdict(r)}
            out.writerow({k: values.get(k) for k in CSV_FIELDS})


def require_matplotlib() -> None:
    """Fail before any measurement when a plot is asked for and matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError("the plot needs matplotlib: pip install 'paratrain[plot]' (or pass --no-plot)") from None


def write_plot(result: BenchResult, path: Path) -> None:
    """Two panels: speedup against world size with the ideal line, and throughput of every configuration."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result.rows if r.skipped is None]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    top = max((r.world for r in rows), default=1)
    left.plot([1, top], [1, top], "k--", lw=1, label="ideal")
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.speedup is None:
            continue
        if r.world == 1 and r.label == "single":
            key, x = "1 process, more threads", r.threads // min(s.threads for s in rows)
        else:
            key, x = r.label, r.world
        series.setdefault(key, []).append((x, r.speedup))
    styles = {"torch-ddp": dict(color="gray", linestyle="--", marker="s")}
    baseline = next((r for r in rows if r.speedup == 1.0 and r.world == 1), None)
    for key, points in series.items():
        if baseline is not None and key != "1 process, more threads":
            points = [(1, 1.0), *points]
        points.sort()
        left.plot([p[0] for p in points], [p[1] for p in points], **styles.get(key, {"marker": "o"}), label=key)
    over = [r for r in rows if r.oversubscribed and r.speedup is not None]
    if over:
        left.scatter(
            [r.world for r in over],
            [r.speedup for r in over],
            s=140,
            facecolors="none",
            edgecolors="red",
            label="oversubscribed",
        )
    left.set_xticks(sorted({x for points in series.values() for x, _ in points} | {1}))
    left.set_xlabel("world size (for threads: ranks' worth of threads)")
    left.set_ylabel("speedup over 1 process")
    left.set_title(f"{result.config.scaling} scaling, {result.config.workload}")
    left.legend(fontsize=8)
    left.grid(alpha=0.3)
    names = [r.name + (" *" if r.oversubscribed else "") for r in rows]
    right.barh(
        range(len(rows)),
        [r.samples_per_s for r in rows],
        color=["tab:red" if r.oversubscribed else "tab:blue" for r in rows],
    )
    right.set_yticks(range(len(rows)), names, fontsize=8)
    right.invert_yaxis()
    right.set_xlabel("samples/s")
    right.set_title("throughput per configuration (* oversubscribed)")
    right.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
