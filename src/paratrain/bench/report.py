"""The terminal report of a benchmark: one table, the torch-ddp comparison, the fastest configuration, caveats."""

from __future__ import annotations

from .result import BenchResult, Row

_MEMORY = {
    "rss_peak": "peak RSS MiB",
    "rss_peak_since_process_start": "peak RSS MiB",
    "cuda_max_allocated": "peak CUDA MiB",
}


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _bytes(value: float | None) -> str:
    if value is None:
        return "-"
    for unit, size in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if value >= size:
            return f"{value / size:.{1 if value >= 100 * size else 2}f}{unit}"
    return f"{value:.0f}"


def _name(row: Row) -> str:
    return row.name + (" *" if row.oversubscribed else "")


def _line(row: Row, width: int) -> str:
    name = _name(row)
    if row.skipped:
        return f"{name:<{width}} skipped: {row.skipped}"
    eff = "-" if row.efficiency is None else f"{row.efficiency:.2f}"
    return (
        f"{name:<{width}}{row.world:>5}{row.threads:>4}{row.global_batch:>7}{row.samples_per_s:>11.0f}"
        f"{row.step_ms:>9.2f}{row.step_p90_ms:>8.2f}{_times(row.speedup):>9}{eff:>6}{_pct(row.comm_share):>6}"
        f"{_pct(row.data_share):>6}{_pct(row.imbalance):>7}{_bytes(row.bytes_per_step):>11}"
        f"{max(row.peak_mb, default=0):>14.0f}"
    )


def format_report(result: BenchResult) -> str:
    cfg = result.config
    width = max([22, *(len(_name(r)) + 1 for r in result.rows)])  # pipeline/interleaved-1f1b x2: longer
    kinds = {r.memory_kind for r in result.rows if r.memory_kind}
    memory = _MEMORY.get(next(iter(kinds), "rss_peak"), "peak MiB")
    scaling = (
        f"weak scaling: {cfg.batch} samples per replica"
        if cfg.scaling == "weak"
        else f"strong scaling: {cfg.batch} samples per step"
    )
    lines = [
        f"paratrain bench: {result.workload}",
        f"{scaling}; {cfg.rounds} rounds of {cfg.warmup} warm-up + {cfg.steps} timed steps; "
        f"{result.machine.describe()}; paratrain {result.versions['paratrain']}, torch {result.versions['torch']}",
        "",
        f"{'config':<{width}}{'world':>5}{'thr':>4}{'batch':>7}{'samples/s':>11}{'step ms':>9}{'p90 ms':>8}"
        f"{'speedup':>9}{'eff':>6}{'comm':>6}{'data':>6}{'imbal':>7}{'bytes/step':>11}{memory:>14}",
    ]
    lines += [_line(row, width) for row in result.rows]
    over = sorted({r.oversubscribed for r in result.rows if r.oversubscribed})
    if over:
        lines.append(
            f"* oversubscribed ({'; '.join(over)}): ranks share hardware, so these rows understate what "
            "the same world size does on enough cores or GPUs"
        )
    if any(r.servers for r in result.rows):
        lines.append(
            "rows with servers: the batch, samples/s, step times, bytes/step and memory are the workers' "
            "(world minus servers); speedup and efficiency count every process, servers included, so a "
            "row compares with the others at the same world (and with ddp at the workers' count)"
        )
    lines.append("")
    for c in result.comparisons:
        diff = (
            ""
            if c.max_param_diff is None
            else f"; parameters after the same steps differ by at most {c.max_param_diff:.3g}"
        )
        lines.append(
            f"paratrain ddp vs hand-written DDP at world {c.world}: overhead {c.overhead:.3f} (median of "
            f"{len(c.rounds)} interleaved rounds: {' '.join(f'{x:.3f}' for x in c.rounds)}); "
            f"{c.paratrain_ms:.2f} vs {c.torch_ms:.2f} ms per step{diff}"
        )
    best = result.fastest
    if best is not None:
        lines.append(f"fastest on this machine: {best.name} ({best.samples_per_s:.0f} samples/s)")
    lines.append(
        f"{memory.replace(' MiB', '')} is the largest rank's, in MiB; comm = share of the step spent waiting "
        "for gradient communication (ps: in its pulls and pushes), data = waiting for the next batch, "
        "imbal = slowest rank's own work over "
        "the mean; bytes/step = what one training rank sends plus receives per step in MiB/KiB (ddp: its "
        "gradient ring all-reduce, computed; ps: its messages, measured; - : not counted) (see docs/bench.md)"
    )
    lines += [
        f"{r.name}: expert parallelism's all-to-all (dispatch and combine, forward and backward, as ep "
        f"over its {r.world} ranks would send them; timed with all_to_all_single, not run by the strategy) "
        f"takes {r.all_to_all_ms:.2f} ms per step ({r.all_to_all_ms / r.step_ms:.0%} of the step's time), "
        f"{_bytes(r.all_to_all_bytes)}B per rank"
        for r in result.rows
        if r.all_to_all_ms is not None
    ]
    lines += result.notes
    lines.append(f"(bench took {result.wall_s:.0f} s)")
    return "\n".join(lines)
