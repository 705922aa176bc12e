"""Running a benchmark: one job per world size (and per thread count), launched with ``paratrain.launch``.

Every rank of a world size is one 'device' of the same size: each gets ``threads_per_rank`` threads at every
world size, so world 1 is one device and efficiency = speedup / world size means what it means on GPUs.
With ``threads`` the same hardware as world k is also given to one process (k x the threads), which on a
CPU-only machine is often the faster way to use it.

A strategy whose ranks serve instead of training (``ps``) gets a job of its own at each world size: its servers
serve from ``prepare`` until the workers close and then end their processes, returning nothing; its row is its
workers'.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, replace
from typing import TextIO

from ..composition import PIPELINES
from ..devices import select_device
from ..errors import ConfigError
from ..launcher.spawn import launch
from ..strategies import check_world, sends_host_tensors, serves
from ..workloads import get_workload
from .config import BASELINE, BenchConfig
from .machine import BackgroundLoad, Machine
from .measure import TORCH_DDP, Run, run_job
from .result import BenchResult, Comparison, Row, add_speedups, compare, summarise

BUSY = 0.05
"""Above this share of the CPUs used by other processes, the report calls its timings suspect."""


@dataclass(frozen=True, kw_only=True)
class Job:
    """One launch: ``world`` processes of ``threads`` threads timing ``runs`` in turn."""

    world: int
    threads: int
    config: BenchConfig
    runs: tuple[Run, ...]


def plan_jobs(config: BenchConfig, machine: Machine) -> tuple[list[Job], list[Row], list[str]]:
    """The jobs to launch, rows for configurations that cannot run here, and notes for the report."""
    threads = config.rank_threads(machine.cores)
    jobs = [Job(world=1, threads=threads, config=config, runs=(Run(label=BASELINE, strategy=BASELINE),))]
    skipped: list[Row] = []
    notes: list[str] = []
    for world in config.nprocs[1:]:
        if machine.gpus and world > machine.gpus:
            notes.append(
                f"world {world} not run: it needs {world} GPUs and {machine.gpus} are visible "
                "(use --accelerator cpu to run it on the CPU)"
            )
            continue
        runs, served = [], []
        for name, schedule in _configurations(config):
            serving = serves(name)
            options = {**config.strategy_options.get(name, {}), **_tp_options(config, name)}
            if serving and config.servers is not None:
                options["servers"] = config.servers
            label = f"{name}+tp{config.tp}" if "tp" in options and name != "tp" else name
            if schedule is not None:
                options["schedule"], label = schedule, f"{label}/{schedule}"
            reason = _cannot_run(name, options, world)
            if reason:
                skipped.append(Row(label=label, world=world, threads=threads, skipped=reason))
            else:
                (served if serving else runs).append(
                    Run(
                        label=label,
                        strategy=name,
                        options=options,
                        serves=serving,
                        host_tensors=sends_host_tensors(name, **options),
                    )
                )
        if config.compare and any(r.label == "ddp" for r in runs):
            runs.append(Run(label=TORCH_DDP, strategy=None))
        if runs:
            jobs.append(Job(world=world, threads=threads, config=config, runs=tuple(runs)))
        jobs += [Job(world=world, threads=threads, config=config, runs=(run,)) for run in served]
    if config.threads:
        if machine.gpus:
            notes.append("--threads compares CPU threads with processes; skipped on a GPU machine")
        else:
            for world in config.nprocs[1:]:
                batch = config.batch * world if config.scaling == "weak" else config.batch
                jobs.append(
                    Job(
                        world=1,
                        threads=threads * world,
                        config=replace(config, batch=batch),
                        runs=(Run(label=BASELINE, strategy=BASELINE),),
                    )
                )
    return jobs, skipped, notes


def _configurations(config: BenchConfig) -> list[tuple[str, str | None]]:
    """(strategy, pipeline schedule) of each run at a world size: a pipeline strategy once per ``--schedules``
    entry, the others (and a pipeline without ``--schedules``) once, under their own options."""
    return [
        (name, schedule)
        for name in config.strategies
        for schedule in (config.schedules if name in PIPELINES and config.schedules else (None,))
    ]


def _strategy_of(label: str) -> str:
    """The strategy a row's label names (``pipeline+tp2/zbv``: ``pipeline``)."""
    return label.split("/")[0].split("+tp")[0]


def _tp_options(config: BenchConfig, strategy: str) -> dict:
    """``--tp``'s options for ``strategy``, with the workload's own plan when it has one."""
    from ..distributed.tensor_parallel.degrees import cli_options
    from ..workloads import get_workload

    if strategy != "tp" and config.tp in (None, 1):
        return {}
    # the tp strategy splits over every rank of each world size: --tp is the degree of the others
    return cli_options(strategy, None if strategy == "tp" else config.tp, get_workload(config.workload).tp_plan)


def _cannot_run(strategy: str, options: dict, world: int) -> str | None:
    """Why ``strategy`` cannot run on ``world`` processes (its own one-line error), or None."""
    try:
        check_world(strategy, world, **options)
    except ConfigError as err:
        return str(err)
    return None


def run_bench(config: BenchConfig, *, log: TextIO | None = None) -> BenchResult:
    """Run every configuration of ``config`` and return the rows (progress lines go to ``log``, default stderr)."""
    import torch

    from ..version import __version__

    log = sys.stderr if log is None else log
    started = time.perf_counter()
    load = BackgroundLoad()
    select_device(0, config.accelerator)  # accelerator='cuda' without CUDA fails here, in one line
    machine = Machine.here(config.accelerator)
    workload = get_workload(config.workload)  # so does a bad workload name or factory
    jobs, rows, notes = plan_jobs(config, machine)
    comparisons: list[Comparison] = []
    for i, job in enumerate(jobs, 1):
        labels = ", ".join(r.label for r in job.runs)
        print(
            f"paratrain bench: [{i}/{len(jobs)}] {job.world} process(es) x {job.threads} thread(s): {labels} "
            f"({config.rounds} rounds of {config.warmup}+{config.steps} steps)",
            file=log,
            flush=True,
        )
        t0 = time.perf_counter()
        ranks = launch(
            run_job, job.world, args=(job.config, list(job.runs)), threads=job.threads, timeout_s=config.timeout_s
        )
        print(f"paratrain bench: [{i}/{len(jobs)}] done in {time.perf_counter() - t0:.1f} s", file=log, flush=True)
        over = machine.oversubscribed(job.world, job.threads)
        for run in job.runs:
            records = [rank[run.label] for rank in ranks if rank is not None]  # None: a server's (it ended serving)
            row = summarise(run.label, job.world, job.threads, records)
            row.servers = job.world - len(records)
            row.oversubscribed = over
            rows.append(row)
        if TORCH_DDP in ranks[0]:
            found = compare(job.world, [r["ddp"] for r in ranks], [r[TORCH_DDP] for r in ranks])
            if found is not None:
                comparisons.append(found)
    add_speedups(rows)
    background = load.share()
    if background > BUSY:
        notes.append(
            f"other processes used {100 * background:.0f}% of this machine's CPUs while the bench ran: "
            "the timings are suspect; measure on an idle machine"
        )
    order = [BASELINE, *config.strategies, TORCH_DDP]
    rows.sort(key=lambda r: (r.world * r.threads, r.world, order.index(_strategy_of(r.label))))
    return BenchResult(
        config=config,
        machine=machine,
        workload=workload.description or workload.name,
        rows=rows,
        comparisons=comparisons,
        notes=notes,
        versions={"paratrain": __version__, "torch": torch.__version__},
        wall_s=time.perf_counter() - started,
        background_share=background,
    )
