"""The planner's predicted step time against the measured one, per strategy and world size (CPU, gloo).

    .venv/bin/python benchmarks/planner_accuracy.py                  # world 1, 2 and 4; 3 rounds x 10 steps
    .venv/bin/python benchmarks/planner_accuracy.py --quick          # world 1 and 2; 1 round x 5 steps
    .venv/bin/python benchmarks/planner_accuracy.py --json out.json

Model and setup are ``strategies.py``'s: MLP 784-1024x4-10, Adam, fp32, global batch 128 fixed.

Calibration, world 1 only: the plain model in this process on one thread, the forward+backward of the whole
batch of 128 and the Adam step timed apart (median of interleaved rounds), before and after each launched world
size; that world is predicted from the mean of the two, so a machine whose load drifts skews it less.
``make_plan(step_time=forward+backward, optimizer_time=Adam step, threads=1)`` turns them into the host's FLOP rate
and memory bandwidth (docs/planner.md, "Calibrating"); the planner then splits the global batch per replica itself.
The same is timed at torch's default thread count once, for reference.

Link figures, per world size: each launched job first times the collectives the strategies use on the model's
15.8 MB of gradients (all-reduce, all-gather, reduce-scatter, ZeRO-1's per-shard broadcasts) and point-to-point
sends of a pipeline's 64 KB activations and of 4 MB, before it runs any strategy; ``make_plan(link_timings=...)``
sets the link from them (``timing.measured_link``). Predictions are shown with those figures and with the
catalogue's ``loopback-gloo``.

Measured: ``strategies.run_rounds`` (every strategy in the same processes, interleaved rounds, slowest rank,
median of round medians). Error is predicted / measured - 1; the target is |error| <= 20%. Each part reports the
share of the cores other processes used meanwhile (as ``ddp_overhead.py`` does); above 5% the numbers are skewed.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # strategies.py, and "strategies:build_model"

import strategies  # noqa: E402

import paratrain  # noqa: E402
from paratrain.planner import make_plan  # noqa: E402

TARGET = 0.20
PLANNER_TO_LABEL = {"ddp": "ddp", "zero1": "zero1", "zero2": "zero2", "fsdp": "zero3",
                    "pipeline": "pipeline-1f1b-8"}
"""Planner strategy name -> ``strategies.STRATEGIES`` label (zero3 is the planner's ``fsdp``)."""
GLOBAL = strategies.GLOBAL_BATCH
MICRO_BATCHES = 8
BOUNDARY_BYTES = GLOBAL // MICRO_BATCHES * strategies.MODEL_WIDTH * 4
"""What a pipeline stage sends per micro-batch: 16 samples x 1024 fp32 activations."""
CORES = len(os.sched_getaffinity(0))
T = TypeVar("T")


def machine_cpu_s() -> float:
    """CPU seconds every process on this machine has used since boot (from /proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq = map(int, Path("/proc/stat").read_text().split()[1:8])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and every descendant it has reaped (the launched ranks)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def audited(fn: Callable[[], T]) -> tuple[T, float, float]:
    """``fn()``, its wall seconds, and the share of the machine other processes used meanwhile."""
    machine0, own0, t0 = machine_cpu_s(), own_cpu_s(), time.perf_counter()
    result = fn()
    wall = time.perf_counter() - t0
    foreign = (machine_cpu_s() - machine0) - (own_cpu_s() - own0)
    return result, wall, max(0.0, foreign) / (wall * CORES)


def load_note(wall: float, share: float) -> str:
    return f"{wall:.0f} s, other processes used {100 * share:.1f}% of the {CORES} cores" + (
        " (above 5%: skewed)" if share > 0.05 else "")


def _median_s(fn: Callable[[], object], steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def single_phases(threads: int, steps: int, warmup: int) -> tuple[float, float]:
    """Median seconds of the plain model's forward+backward on the global batch, and of its Adam step."""
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

        forward_backward()
        return _median_s(forward_backward, steps, warmup), _median_s(opt.step, steps, warmup)
    finally:
        torch.set_num_threads(before)


def measure_single(rounds: int, steps: int, warmup: int, counts: list[int]) -> dict[int, tuple[float, float]]:
    """Per thread count: medians over interleaved rounds of (forward+backward, Adam step)."""
    per_round: dict[int, list[tuple[float, float]]] = {n: [] for n in counts}
    for r in range(rounds):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            per_round[n].append(single_phases(n, steps, warmup))
    return {n: (statistics.median(t[0] for t in ts), statistics.median(t[1] for t in ts))
            for n, ts in per_round.items()}


def link_timings(nbytes: int, repeats: int) -> dict[str, tuple[float, float]]:
    """This rank's median seconds per collective, as the strategies issue them (inside a process group)."""
    n, rank = dist.get_world_size(), dist.get_rank()
    numel = nbytes // 4 // n * n
    full, shard = torch.randn(numel), torch.empty(numel // n)
    shards = full.chunk(n)

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
    ops = {"all_reduce": (numel * 4, lambda: dist.all_reduce(full)),
           "all_gather": (numel * 4, lambda: all_gather(full, shard)),
           "reduce_scatter": (numel * 4, lambda: reduce_scatter(shard, full)),
           "broadcast": (numel * 4, broadcasts),
           "p2p_small": (BOUNDARY_BYTES, p2p(BOUNDARY_BYTES)),
           "p2p": (4 * 2**20, p2p(4 * 2**20))}
    out = {}
    for name, (size, op) in ops.items():
        dist.barrier()
        out[name] = (size, _median_s(op, repeats, 2))
    return out


def accuracy_job(labels: list[str], rounds: int, steps: int, warmup: int) -> dict[str, object]:
    """One rank: the link figures first, then every strategy (``strategies.run_rounds``)."""
    dist.init_process_group("gloo")
    params = sum(p.numel() for p in strategies.build_model().parameters())
    link = link_timings(params * 4, repeats=max(steps, 5))
    out = {"link": link, "rounds": strategies.run_rounds(labels, rounds, steps, warmup)}
    dist.destroy_process_group()
    return out


def slowest_link(ranks: list[dict[str, object]]) -> dict[str, tuple[float, float]]:
    """Per collective, the slowest rank's time (a collective ends when its last rank does; a send when it is
    received)."""
    links = [r["link"] for r in ranks]
    return {name: (links[0][name][0], max(link[name][1] for link in links)) for name in links[0]}


def predict(world: int, forward_backward_s: float, optimizer_s: float,
            link: dict[str, tuple[float, float]] | None) -> dict[str, float]:
    """Predicted step seconds per planner strategy at ``world`` ranks on this host, calibrated on world 1."""
    plan = make_plan(model="strategies:build_model", input_spec="784", gpu="cpu", gpus=world, precision="fp32",
                     optimizer="adam", micro_batch=GLOBAL, global_batch=GLOBAL, micro_batches=MICRO_BATCHES,
                     schedule="1f1b", step_time=forward_backward_s, optimizer_time=optimizer_s, threads=1,
                     link_timings=link)
    return {e.name: e.time.step_s for e in plan.estimates}


def error(predicted_s: float, measured_s: float) -> float:
    return predicted_s / measured_s - 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4", help="launched world sizes (world 1 always runs)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="world 1 and 2, 1 round, 5 steps")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    worlds = [2] if a.quick else [int(w) for w in a.worlds.split(",")]
    rounds, steps = (1, 5) if a.quick else (a.rounds, a.steps)
    default_threads = torch.get_num_threads()
    calibration_rounds = rounds if a.quick else max(rounds, 3)
    print(f"paratrain {paratrain.__version__}, torch {torch.__version__}, {CORES} cores, gloo; "
          f"MLP 784-{strategies.MODEL_WIDTH}x4-10, Adam, fp32, global batch {GLOBAL}; {rounds} round(s) x {steps} "
          f"timed steps")

    single, wall, share = audited(lambda: measure_single(calibration_rounds, steps, a.warmup,
                                                         sorted({1, default_threads})))
    before = single[1]
    print(f"world 1, 1 thread: forward+backward {1e3 * before[0]:.1f} ms + Adam step {1e3 * before[1]:.1f} ms; at "
          f"{default_threads} threads {1e3 * single[default_threads][0]:.1f} + {1e3 * single[default_threads][1]:.1f} "
          f"ms; {load_note(wall, share)}")
    shares, links, rows, calibrations = {"1": share}, {}, [], {}
    for world in worlds:
        catalogue = predict(world, *before, None)
        labels = {name: label for name, label in PLANNER_TO_LABEL.items() if name in catalogue}
        ranks, wall, shares[str(world)] = audited(lambda: paratrain.launch(
            accuracy_job, world, (list(labels.values()), rounds, steps, a.warmup), timeout_s=900))
        links[world] = slowest_link(ranks)
        summary = strategies.summarise(world, [r["rounds"] for r in ranks])
        measured = {r["strategy"]: r["step_ms"] / 1e3 for r in summary}
        figures = ", ".join(f"{name} {1e3 * s:.1f} ms" for name, (_, s) in links[world].items())
        print(f"world {world}: measured in {load_note(wall, shares[str(world)])}; link: {figures}")
        again, wall, shares[f"1 after {world}"] = audited(
            lambda: measure_single(calibration_rounds, steps, a.warmup, [1]))
        after = again[1]
        fb, opt = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2  # the world 1 step around this job
        calibrations[world] = {"before_ms": [1e3 * t for t in before], "after_ms": [1e3 * t for t in after]}
        print(f"world 1 again, 1 thread: {1e3 * after[0]:.1f} + {1e3 * after[1]:.1f} ms "
              f"({sum(after) / sum(before) - 1:+.1%}); world {world} is predicted from the mean, "
              f"{1e3 * fb:.1f} + {1e3 * opt:.1f} ms; {load_note(wall, shares[f'1 after {world}'])}")
        catalogue, with_link = predict(world, fb, opt, None), predict(world, fb, opt, links[world])
        rows += [{"world": world, "strategy": label, "measured_ms": 1e3 * measured[label],
                  "predicted_ms": 1e3 * with_link[name], "error": error(with_link[name], measured[label]),
                  "catalogue_link_ms": 1e3 * catalogue[name],
                  "catalogue_link_error": error(catalogue[name], measured[label])}
                 for name, label in labels.items()]
        before = after

    print(f"\n{'world':>5} {'strategy':<16} {'measured ms':>11} {'predicted ms':>12} {'error':>8}  {'within 20%?':<11}"
          f" {'catalogue link':>14} {'error':>8}")
    for r in rows:
        r["within_target"] = abs(r["error"]) <= TARGET
        print(f"{r['world']:>5} {r['strategy']:<16} {r['measured_ms']:>11.1f} {r['predicted_ms']:>12.1f} "
              f"{r['error']:>+8.1%}  {'yes' if r['within_target'] else 'NO':<11} {r['catalogue_link_ms']:>14.1f} "
              f"{r['catalogue_link_error']:>+8.1%}")
    within = sum(r["within_target"] for r in rows)
    catalogue_within = sum(abs(r["catalogue_link_error"]) <= TARGET for r in rows)
    print(f"within {TARGET:.0%}: {within} of {len(rows)} cases with measured link figures, {catalogue_within} of "
          f"{len(rows)} with the catalogue's")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"calibration_ms": calibrations, "threads": 1, "default_threads": default_threads,
                       "default_threads_ms": [1e3 * t for t in single[default_threads]],
                       "background_share": shares, "link_timings": links, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
