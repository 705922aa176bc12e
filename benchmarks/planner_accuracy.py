"""The planner's predicted step time against the measured one, per strategy and world size (CPU, gloo).

    .venv/bin/python benchmarks/planner_accuracy.py                  # world 1, 2 and 4; 3 rounds x 10 steps
    .venv/bin/python benchmarks/planner_accuracy.py --quick          # world 1 and 2; 1 round x 5 steps
    .venv/bin/python benchmarks/planner_accuracy.py --json out.json

Model and setup are ``strategies.py``'s: MLP 784-1024x4-10, Adam, fp32, global batch 128 fixed.

Calibration, world 1 only, in this process (median of interleaved rounds, before and after each launched world
size; that world is predicted from the mean of the two, so a machine whose load drifts skews it less):

- one thread: the forward+backward of the whole batch of 128, the same batch as 8 micro-batches of 16 (per
  micro-batch), and the Adam step, each timed apart: the FLOP rate, the weight passes (the batch-independent
  part of a forward+backward) and the memory bandwidth;
- all cores (threads of this process; with ``--host-rate processes``, one single-threaded process per core
  instead): the same forward+backward and Adam step: what the host sustains when every core is busy, which each
  of N processes gets 1/N of;
- whole steps of ``single``, ``zero2`` and ``zero3`` through ``paratrain.Parallel`` on one thread, the FSDP ones on
  a private one-rank group: FSDP's own machinery (hooks, copies, DTensor optimizer step) with nothing to
  communicate is their difference.

``PlanConfig(step_time=..., optimizer_time=..., threads=1, measured=Measured(micro_step_time=..., host_step_time=...,
fsdp_overhead=...))`` turns them into the planner's constants (docs/planner-model.md, "Calibrating"); the planner then
splits the global batch per replica itself. glibc's allocator is told to keep freed memory (``MALLOC_ENV``, for this
process and the ranks alike): by default the Adam step's timing depends on page faults.

Link figures, per world size: each launched job first times the collectives the strategies use on the model's
15.8 MB of gradients (all-reduce, all-gather, reduce-scatter, ZeRO-1's per-shard broadcasts), all-gather and
reduce-scatter again split into one call per FSDP wrap unit (what a call costs beyond its bytes), a few-byte
all-reduce (latency) and point-to-point sends of a pipeline's 64 KB activations and of 4 MB, before it runs any
strategy; ``Measured(link_timings=...)`` sets the link from them (``timing.measured_link``). Predictions are shown
with those figures and with the catalogue's ``loopback-gloo``.

Measured: ``strategies.run_rounds`` (every strategy in the same processes, interleaved rounds, slowest rank,
median of round medians). Error is predicted / measured - 1; the target is |error| <= 20%. Each part reports the
share of the cores other processes (and the hypervisor: steal) used meanwhile (as ``ddp_overhead.py`` does);
above 5% the numbers are skewed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # strategies.py, and "strategies:build_model"

import strategies  # noqa: E402

import paratrain  # noqa: E402
from paratrain.distributed.process_group import finish_group  # noqa: E402
from paratrain.planner import Measured, ModelSpec, PlanConfig, Training, make_plan  # noqa: E402
from paratrain.workloads.model_names import resolve_model  # noqa: E402

TARGET = 0.20
PLANNER_TO_LABEL = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "zero3": "zero3", "pipeline": "pipeline-1f1b-8"}
"""Planner strategy name -> ``strategies.STRATEGIES`` label."""
GLOBAL = strategies.GLOBAL_BATCH
MICRO_BATCHES = 8
BOUNDARY_BYTES = GLOBAL // MICRO_BATCHES * strategies.MODEL_WIDTH * 4
"""What a pipeline stage sends per micro-batch: 16 samples x 1024 fp32 activations."""
MODEL = resolve_model(ModelSpec(model="strategies:build_model", input_spec="784"))
"""The benchmark's model as the planner builds and traces it."""
UNIT_PARAMS = [n for _, n in MODEL.find_stats().units if n > 0]
"""Parameters per FSDP wrap unit, as the planner counts them (``timing.unit_count``): one collective call each."""
CORES = len(os.sched_getaffinity(0))
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**30)}
"""glibc keeps freed memory instead of returning it to the OS: by default it gives back what PyTorch frees (the
optimizer step's and FSDP's multi-MB temporaries) and faults it in again on the next step, which made a one-thread
Adam step take 7.5 ms with no page faults and 20-30 ms with 6,000 per step, depending on the heap's history. Set
for the whole benchmark (calibration and ranks alike); ``--default-malloc`` keeps the default."""
T = TypeVar("T")


def machine_cpu_s() -> float:
    """CPU seconds every process on this machine has used since boot, plus the time the hypervisor gave this
    virtual machine's cores to others (steal): both slow the measured runs down (from /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, Path("/proc/stat").read_text().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and every descendant it has reaped (the launched ranks)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def audited(fn: Callable[[], T]) -> tuple[T, float, float]:
    """``fn()``, its wall seconds, and the share of the machine other processes (and the hypervisor) used
    meanwhile."""
    machine0, own0, t0 = machine_cpu_s(), own_cpu_s(), time.perf_counter()
    result = fn()
    wall = time.perf_counter() - t0
    foreign = (machine_cpu_s() - machine0) - (own_cpu_s() - own0)
    return result, wall, max(0.0, foreign) / (wall * CORES)


def load_note(wall: float, share: float) -> str:
    return f"{wall:.0f} s, other processes and steal used {100 * share:.1f}% of the {CORES} cores" + (
        " (above 5%: skewed)" if share > 0.05 else ""
    )


def median_s(fn: Callable[[], object], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def single_phases(steps: int, warmup: int, threads: int = 1) -> dict[str, float]:
    """Median seconds of the plain model's ``forward_backward`` on the global batch, of one forward+backward of a
    pipeline's micro-batch (``micro_batch``: the batch cut in ``MICRO_BATCHES``, all run, divided by their number)
    and of its ``adam`` step."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = strategies.build_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(GLOBAL, 784, generator=g), torch.randint(0, 10, (GLOBAL,), generator=g)

        def forward_backward() -> None:
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()

        def micro_batches() -> None:
            opt.zero_grad(set_to_none=True)
            for xs, ys in zip(x.chunk(MICRO_BATCHES), y.chunk(MICRO_BATCHES)):
                nn.functional.cross_entropy(model(xs), ys).backward()

        forward_backward()
        return {
            "forward_backward": median_s(forward_backward, steps, warmup),
            "micro_batch": median_s(micro_batches, steps, warmup) / MICRO_BATCHES,
            "adam": median_s(opt.step, steps, warmup),
        }
    finally:
        torch.set_num_threads(before)


def one_rank_step_s(label: str, steps: int, warmup: int) -> float:
    """Median seconds of a whole training step of ``label`` (``single`` or a ``strategies.STRATEGIES`` label) in
    this plain process on one thread: the strategy runs on its private one-rank group, so FSDP runs its hooks,
    copies and sharded optimizer step with nobody to communicate with."""
    strategy, options = strategies.STRATEGIES.get(label, (label, {}))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    par = paratrain.Parallel(strategy, **options)
    try:
        model = strategies.build_model()
        model, opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4))
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(GLOBAL, 784, generator=g), torch.randint(0, 10, (GLOBAL,), generator=g)

        def step() -> None:
            with par.step(model, opt):
                par.forward_backward(model, x, y, nn.functional.cross_entropy)

        return median_s(step, steps, warmup)
    finally:
        with contextlib.redirect_stdout(io.StringIO()):  # the monitor's one-rank summary table
            par.close()
        torch.set_num_threads(before)


def _phases_after(barrier: object, steps: int, warmup: int, out: object) -> None:
    barrier.wait()  # type: ignore[attr-defined]
    out.put(single_phases(steps, warmup))  # type: ignore[attr-defined]


def concurrent_phases(steps: int, warmup: int) -> dict[str, float]:
    """``single_phases`` on one thread in each of ``CORES`` processes at once, as host-equivalent seconds (each
    process's median over ``CORES``, averaged): what the host sustains when every core runs a process of its own,
    as the ranks do. Separate processes, unlike threads of one, share no intra-op thread pool or allocator."""
    ctx = multiprocessing.get_context("spawn")  # the parent's OpenMP pool is not fork-safe
    barrier, out = ctx.Barrier(CORES), ctx.Queue()
    procs = [ctx.Process(target=_phases_after, args=(barrier, steps, warmup, out)) for _ in range(CORES)]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=600) for _ in procs]
    for proc in procs:
        proc.join()
    return {k: statistics.mean(r[k] for r in results) / CORES for k in results[0]}


HOST_RATES = {"threads": "host_", "processes": "procs_"}
"""``--host-rate``: which all-cores timing sets the host's rates (``measure_world1``'s key prefix)."""


ONE_RANK = ("single", "zero2", "zero3")
"""Strategies timed whole at world 1: FSDP's own machinery is zero2's and zero3's step minus single's."""


def measure_world1(rounds: int, steps: int, warmup: int, host_rate: str = "threads") -> dict[str, float]:
    """World 1, medians over interleaved rounds: ``single_phases`` on one thread, the all-cores timing
    ``host_rate`` names (``HOST_RATES``) and ``ONE_RANK``'s whole steps."""
    all_cores = {
        "threads": lambda: single_phases(steps, warmup, threads=CORES),
        "processes": lambda: concurrent_phases(steps, warmup),
    }[host_rate]
    parts: list[Callable[[], dict[str, float]]] = [
        lambda: single_phases(steps, warmup),
        lambda: {f"{HOST_RATES[host_rate]}{k}": v for k, v in all_cores().items()},
        *(lambda label=label: {label: one_rank_step_s(label, steps, warmup)} for label in ONE_RANK),
    ]
    per_round: dict[str, list[float]] = {}
    for r in range(rounds):
        for part in parts if r % 2 == 0 else parts[::-1]:
            for name, seconds in part().items():
                per_round.setdefault(name, []).append(seconds)
    return {name: statistics.median(ts) for name, ts in per_round.items()}


def describe_world1(w: dict[str, float]) -> str:
    ms = {k: 1e3 * v for k, v in w.items()}
    return (
        f"forward+backward {ms['forward_backward']:.1f} ms (per micro-batch of {GLOBAL // MICRO_BATCHES}: "
        f"{ms['micro_batch']:.1f}) + Adam {ms['adam']:.1f} ms; whole steps: single {ms['single']:.1f}, zero2 "
        f"{ms['zero2']:.1f}, zero3 {ms['zero3']:.1f} ms"
    )


def link_timings(unit_params: list[int], repeats: int) -> dict[str, tuple[float, ...]]:
    """This rank's median seconds per collective, as the strategies issue them (inside a process group): every
    call starts after a barrier, the collectives in turn, so a slow spell of the machine hits all of them alike
    and back-to-back sends do not queue behind a receiver that is not scheduled. All-gather and reduce-scatter
    run twice: on the whole model's bytes in one call, and split into one call per FSDP wrap unit
    (``unit_params``, each unit's parameter count) as FSDP issues them (``*_split``: bytes, seconds, calls)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    units = [p // n * n for p in unit_params]
    numel = sum(units)
    full, shard = torch.randn(numel), torch.empty(numel // n)
    shards = full.chunk(n)
    unit_full = list(full.split(units))
    unit_shard = [torch.empty(u // n) for u in units]

    def broadcasts() -> None:  # ZeroRedundancyOptimizer: every rank broadcasts the parameters it updated
        for work in [dist.broadcast(shards[r], src=r, async_op=True) for r in range(n)]:
            work.wait()

    def p2p(size: int) -> Callable[[], None]:
        buf = torch.empty(size // 4)
        # pipeline neighbours: even ranks send to the next, odd ones receive from the previous
        return (lambda: dist.send(buf, rank + 1)) if rank % 2 == 0 else (lambda: dist.recv(buf, rank - 1))

    # torch 2.13 renamed the tensor forms (*_single) and deprecated the old names; older torch has only those
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    tiny = torch.zeros(2)
    ops = {
        "all_reduce": (numel * 4, lambda: dist.all_reduce(full)),
        "all_reduce_small": (tiny.numel() * 4, lambda: dist.all_reduce(tiny)),
        "all_gather": (numel * 4, lambda: all_gather(full, shard)),
        "reduce_scatter": (numel * 4, lambda: reduce_scatter(shard, full)),
        "all_gather_split": (numel * 4, lambda: [all_gather(f, s) for f, s in zip(unit_full, unit_shard)]),
        "reduce_scatter_split": (numel * 4, lambda: [reduce_scatter(s, f) for f, s in zip(unit_full, unit_shard)]),
        "broadcast": (numel * 4, broadcasts),
        "p2p_small": (BOUNDARY_BYTES, p2p(BOUNDARY_BYTES)),
        "p2p": (4 * 2**20, p2p(4 * 2**20)),
    }
    medians = round_robin_s(ops, repeats)
    return {
        name: (size, medians[name]) + ((len(units),) if name.endswith("_split") else ())
        for name, (size, _) in ops.items()
    }


def round_robin_s(ops: dict[str, tuple[int, Callable[[], object]]], repeats: int) -> dict[str, float]:
    """Median seconds of each collective in ``ops`` (name -> (bytes, call)), timed round-robin, each call started
    together after a barrier; two rounds warm up."""
    times: dict[str, list[float]] = {name: [] for name in ops}
    for r in range(2 + repeats):
        for name, (_, op) in ops.items():
            dist.barrier()
            start = time.perf_counter()
            op()
            if r >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def accuracy_job(labels: list[str], rounds: int, steps: int, warmup: int) -> dict[str, object]:
    """One rank: the link figures first, then every strategy (``strategies.run_rounds``)."""
    dist.init_process_group("gloo")
    link = link_timings(UNIT_PARAMS, repeats=max(2 * steps, 10))
    out = {"link": link, "rounds": strategies.run_rounds(labels, rounds, steps, warmup)}
    finish_group()
    return out


def slowest_link(ranks: list[dict[str, object]]) -> dict[str, tuple[float, ...]]:
    """Per collective, the slowest rank's time (a collective ends when its last rank does; a send when it is
    received)."""
    links = [r["link"] for r in ranks]
    return {name: (links[0][name][0], max(link[name][1] for link in links), *links[0][name][2:]) for name in links[0]}


def predict(
    world: int, world1: dict[str, float], link: dict[str, tuple[float, ...]] | None, host_rate: str = "threads"
) -> dict[str, float]:
    """Predicted step seconds per planner strategy at ``world`` ranks on this host, calibrated on world 1."""
    host = HOST_RATES[host_rate]
    training = Training(
        precision="fp32",
        optimizer="adam",
        micro_batch=GLOBAL,
        global_batch=GLOBAL,
        micro_batches=MICRO_BATCHES,
        schedule="1f1b",
    )
    measured = Measured(
        micro_step_time=(GLOBAL // MICRO_BATCHES, world1["micro_batch"]),
        host_step_time=(world1[f"{host}forward_backward"], world1[f"{host}adam"]),
        fsdp_overhead={"zero2": world1["zero2"] - world1["single"], "zero3": world1["zero3"] - world1["single"]},
        link_timings=link,
    )
    plan = make_plan(
        MODEL,
        PlanConfig(
            gpu="cpu",
            gpus=world,
            training=training,
            step_time=world1["forward_backward"],
            optimizer_time=world1["adam"],
            threads=1,
            measured=measured,
        ),
    )
    return {e.name: e.time.step_s for e in plan.estimates}


def error(predicted_s: float, measured_s: float) -> float:
    return predicted_s / measured_s - 1


def with_steady_allocator() -> None:
    """Re-run this script with ``MALLOC_ENV`` set when it is not (glibc reads it at start; ranks inherit it)."""
    if all(os.environ.get(k) == v for k, v in MALLOC_ENV.items()):
        return
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **MALLOC_ENV})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4", help="launched world sizes (world 1 always runs)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--calibration-steps", type=int, default=30, help="timed steps per world-1 part and round")
    p.add_argument("--quick", action="store_true", help="world 1 and 2, 1 round, 5 steps")
    p.add_argument(
        "--default-malloc",
        action="store_true",
        help="keep glibc's default trimming (freed memory goes back to the OS and faults in again)",
    )
    p.add_argument(
        "--host-rate",
        choices=sorted(HOST_RATES),
        default="threads",
        help="the all-cores timing that sets the host's rates: one process on every core's thread, or "
        "one single-threaded process per core at once",
    )
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    if not a.default_malloc:
        with_steady_allocator()
    worlds = [2] if a.quick else [int(w) for w in a.worlds.split(",")]
    rounds, steps = (1, 5) if a.quick else (a.rounds, a.steps)
    cal_rounds, cal_steps = (1, 5) if a.quick else (max(rounds, 3), a.calibration_steps)
    default_threads = torch.get_num_threads()
    malloc = "glibc default" if a.default_malloc else " ".join(f"{k}={v}" for k, v in MALLOC_ENV.items())
    print(
        f"paratrain {paratrain.__version__}, torch {torch.__version__}, {CORES} cores, gloo; "
        f"MLP 784-{strategies.MODEL_WIDTH}x4-10, Adam, fp32, global batch {GLOBAL}; {rounds} round(s) x {steps} "
        f"timed steps; world 1: {cal_rounds} round(s) x {cal_steps}; allocator: {malloc}"
    )

    before, wall, share = audited(lambda: measure_world1(cal_rounds, cal_steps, a.warmup, a.host_rate))
    print(f"world 1, 1 thread: {describe_world1(before)}; {load_note(wall, share)}")
    threaded = single_phases(cal_steps, a.warmup, threads=default_threads)
    print(
        f"world 1, {default_threads} threads (reference): forward+backward {1e3 * threaded['forward_backward']:.1f}"
        f" + Adam {1e3 * threaded['adam']:.1f} ms"
    )
    shares, links, rows, calibrations = {"1": share}, {}, [], {}
    for world in worlds:
        catalogue = predict(world, before, None, a.host_rate)
        labels = {name: label for name, label in PLANNER_TO_LABEL.items() if name in catalogue}
        ranks, wall, shares[str(world)] = audited(
            lambda world=world, labels=labels: paratrain.launch(
                accuracy_job, world, (list(labels.values()), rounds, steps, a.warmup), timeout_s=900
            )
        )
        links[world] = slowest_link(ranks)
        summary = strategies.summarise(world, [r["rounds"] for r in ranks])
        measured = {r["strategy"]: r["step_ms"] / 1e3 for r in summary}
        figures = ", ".join(f"{name} {1e3 * t[1]:.1f} ms" for name, t in links[world].items())
        print(f"world {world}: measured in {load_note(wall, shares[str(world)])}; link: {figures}")
        after, wall, shares[f"1 after {world}"] = audited(
            lambda: measure_world1(cal_rounds, cal_steps, a.warmup, a.host_rate)
        )
        mean = {k: (before[k] + after[k]) / 2 for k in before}  # the world-1 figures around this job
        calibrations[world] = {
            "before_ms": {k: 1e3 * v for k, v in before.items()},
            "after_ms": {k: 1e3 * v for k, v in after.items()},
        }
        print(
            f"world 1 again ({after['single'] / before['single'] - 1:+.1%} single step): {describe_world1(after)}; "
            f"{load_note(wall, shares[f'1 after {world}'])}"
        )
        catalogue, with_link = predict(world, mean, None, a.host_rate), predict(world, mean, links[world], a.host_rate)
        rows += [
            {
                "world": world,
                "strategy": label,
                "measured_ms": 1e3 * measured[label],
                "predicted_ms": 1e3 * with_link[name],
                "error": error(with_link[name], measured[label]),
                "catalogue_link_ms": 1e3 * catalogue[name],
                "catalogue_link_error": error(catalogue[name], measured[label]),
            }
            for name, label in labels.items()
        ]
        before = after

    print(
        f"\n{'world':>5} {'strategy':<16} {'measured ms':>11} {'predicted ms':>12} {'error':>8}  {'within 20%?':<11}"
        f" {'catalogue link':>14} {'error':>8}"
    )
    for r in rows:
        r["within_target"] = abs(r["error"]) <= TARGET
        print(
            f"{r['world']:>5} {r['strategy']:<16} {r['measured_ms']:>11.1f} {r['predicted_ms']:>12.1f} "
            f"{r['error']:>+8.1%}  {'yes' if r['within_target'] else 'NO':<11} {r['catalogue_link_ms']:>14.1f} "
            f"{r['catalogue_link_error']:>+8.1%}"
        )
    within = sum(r["within_target"] for r in rows)
    catalogue_within = sum(abs(r["catalogue_link_error"]) <= TARGET for r in rows)
    print(
        f"within {TARGET:.0%}: {within} of {len(rows)} cases with measured link figures, {catalogue_within} of "
        f"{len(rows)} with the catalogue's"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "calibration_ms": calibrations,
                    "threads": 1,
                    "allocator": malloc,
                    "host_rate": a.host_rate,
                    "default_threads": default_threads,
                    "default_threads_ms": {k: 1e3 * v for k, v in threaded.items()},
                    "background_share": shares,
                    "link_timings": links,
                    "rows": rows,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
