"""``paratrain bench --tf``: samples/s, speedup and efficiency of a Keras job per number of workers.

Each world size is one ``paratrain run --tf`` job of that many workers (``MultiWorkerMirroredStrategy`` from 2;
one worker runs the default strategy) training the digits CNN on generated images under ``model.fit`` at
``--batch`` samples per worker (weak scaling); a round's steps are timed together, and the row gives the median
and the 90th percentile over rounds. Every worker gets the same intra-op threads (cores / the largest
world size), so efficiency compares equal hardware per worker. The rows are the torch bench's
(:class:`paratrain.bench.result.Row`): the same JSON and PNG (:mod:`paratrain.bench.output`).
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from ..bench.machine import Machine
from ..bench.output import require_matplotlib, write_json, write_plot
from ..bench.result import BenchResult, Row, add_speedups
from ..env import cpu_count
from ..errors import ConfigError
from ..version import __version__

WORKLOAD = "tf-digits-cnn"
DESCRIPTION = "Keras digits CNN (conv + 2 dense, 17k parameters), model.fit, SGD, generated 8x8 images"


@dataclass(frozen=True, kw_only=True)
class TFBenchConfig:
    """What ``paratrain bench --tf`` ran (the torch bench's config names torch strategies; this one has none)."""

    workload: str = WORKLOAD
    nprocs: tuple[int, ...] = (1, 2)
    scaling: str = "weak"
    batch: int = 64
    """Samples per worker."""
    steps: int = 20
    warmup: int = 5
    rounds: int = 5
    threads_per_rank: int = 1
    strategy: str = "MultiWorkerMirroredStrategy (1 worker: the default strategy)"

    def __post_init__(self) -> None:
        if not self.nprocs or any(n < 1 for n in self.nprocs):
            raise ConfigError(f"world sizes must be >= 1, got {self.nprocs!r}")
        for name in ("batch", "steps", "rounds"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.warmup < 1:
            raise ConfigError(f"warmup must be >= 1 (the first steps trace the graph), got {self.warmup}")


def bench_tf(
    *,
    nprocs: tuple[int, ...] = (1, 2),
    batch: int = 64,
    steps: int = 20,
    warmup: int = 5,
    rounds: int = 5,
    json_path: Path | None = None,
    plot_path: Path | None = None,
    plot: bool = True,
) -> BenchResult:
    from .launcher import run

    threads = max(1, cpu_count() // max(nprocs or (1,)))
    config = TFBenchConfig(
        nprocs=nprocs, batch=batch, steps=steps, warmup=warmup, rounds=rounds, threads_per_rank=threads
    )
    if plot and (json_path or plot_path):
        require_matplotlib()
    machine = Machine(cores=cpu_count(), physical_cores=cpu_count(), gpus=0)
    start = time.perf_counter()
    rows = []
    with tempfile.TemporaryDirectory(prefix="paratrain-tf-bench-") as tmp:
        for n in nprocs:
            out = os.path.join(tmp, f"world{n}.json")
            run(
                [
                    "-n",
                    str(n),
                    "-m",
                    "paratrain.tf.bench_job",
                    "--batch",
                    str(batch * n),
                    "--steps",
                    str(steps),
                    "--warmup",
                    str(warmup),
                    "--rounds",
                    str(rounds),
                    "--threads",
                    str(threads),
                    "--out",
                    out,
                ]
            )
            rows.append(_row(out, n, threads, machine))
    add_speedups(rows)
    result = BenchResult(
        config=config,
        machine=machine,
        workload=DESCRIPTION,  # type: ignore[arg-type]
        rows=rows,
        comparisons=[],
        notes=["TensorFlow workers: one job per world size, run one after the other"],
        versions={"paratrain": __version__, "tensorflow": metadata.version("tensorflow")},
        wall_s=time.perf_counter() - start,
    )
    if json_path:
        write_json(result, json_path)
    if plot and (plot_path or json_path):
        write_plot(result, plot_path or json_path.with_suffix(".png"))  # type: ignore[union-attr]
    return result


def _row(path: str, world: int, threads: int, machine: Machine) -> Row:
    import json

    with open(path) as f:
        data = json.load(f)
    steps = sorted(data["rounds"])  # seconds per step, one value per round
    if not steps:
        raise ConfigError("the TensorFlow bench job measured no step")
    step = statistics.median(steps)
    return Row(
        label="single" if world == 1 else "mwms",
        world=world,
        threads=threads,
        replicas=data["replicas"],
        global_batch=data["global_batch"],
        samples_per_s=data["global_batch"] / step,
        step_ms=1000 * step,
        step_p90_ms=1000 * steps[round(0.9 * (len(steps) - 1))],
        rounds_ms=[1000 * r for r in data["rounds"]],
        oversubscribed=machine.oversubscribed(world, threads),
        memory_kind="",
    )


def format_tf_report(result: BenchResult) -> str:
    cfg = result.config
    lines = [
        f"paratrain bench --tf: {result.workload}",
        f"weak scaling: {cfg.batch} samples per worker; {cfg.rounds} rounds of {cfg.steps} timed steps after "
        f"{cfg.warmup} warm-up; {result.machine.describe()}; paratrain {result.versions['paratrain']}, "
        f"TensorFlow {result.versions['tensorflow']}",
        "",
        f"{'config':<22}{'world':>5}{'thr':>4}{'batch':>7}{'samples/s':>11}{'step ms':>9}{'p90 ms':>8}"
        f"{'speedup':>9}{'eff':>6}",
    ]
    for r in result.rows:
        speed = "-" if r.speedup is None else f"{r.speedup:.2f}x"
        eff = "-" if r.efficiency is None else f"{r.efficiency:.2f}"
        lines.append(
            f"{r.name + (' *' if r.oversubscribed else ''):<22}{r.world:>5}{r.threads:>4}{r.global_batch:>7}"
            f"{r.samples_per_s:>11.0f}{r.step_ms:>9.2f}{r.step_p90_ms:>8.2f}{speed:>9}{eff:>6}"
        )
    if any(r.oversubscribed for r in result.rows):
        lines.append("* oversubscribed: workers share cores, so these rows understate what enough cores would do")
    lines += result.notes
    lines.append(f"(bench took {result.wall_s:.0f} s)")
    return "\n".join(lines)
