"""The planner's predicted step time against the measured one, per strategy and world size (CPU, gloo).

    .venv/bin/python benchmarks/planner_accuracy.py                  # world 1, 2 and 4; 3 rounds x 10 steps
    .venv/bin/python benchmarks/planner_accuracy.py --quick          # world 1 and 2; 1 round x 5 steps
    .venv/bin/python benchmarks/planner_accuracy.py --json out.json

Model and setup are ``strategies.py``'s: MLP 784-1024x4-10, Adam, fp32, global batch 128 fixed. World 1 is the
plain model in this process (torch's default threads, and 1 thread for reference), a forward + backward +
Adam step on the whole batch of 128. The planner (``paratrain.planner.make_plan``, device ``cpu``) is
calibrated on that default-threads step: ``step_time`` fixes the host's sustained FLOP/s from one micro-batch
of ``micro_batch`` samples, so it is given ``micro_batch=128`` (the batch that step ran; the planner then
splits the global batch per replica itself). Worlds 2 and 4 reuse ``strategies.job`` (every strategy in the
same processes, interleaved rounds, slowest rank, median of round medians). Error is predicted / measured - 1;
the target is |error| <= 20%. World 1 is the calibration point, so its error is 0 by construction. Each part
reports the share of the 2 cores other processes used meanwhile (as ``ddp_overhead.py`` does); above 5% the
numbers are skewed, two-thread world 1 worst of all.
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


def single_step_s(threads: int, steps: int, warmup: int) -> float:
    """Median seconds of one forward + backward + Adam step of the plain model on the global batch."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = strategies.build_model()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(GLOBAL, 784, generator=g), torch.randint(0, 10, (GLOBAL,), generator=g)
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)
    finally:
        torch.set_num_threads(before)


def measure_single(rounds: int, steps: int, warmup: int) -> dict[int, float]:
    """Per thread count (default, 1): the median over interleaved rounds of each round's median step."""
    counts = sorted({torch.get_num_threads(), 1}, reverse=True)
    per_round: dict[int, list[float]] = {n: [] for n in counts}
    for r in range(rounds):
        for n in (counts if r % 2 == 0 else counts[::-1]):
            per_round[n].append(single_step_s(n, steps, warmup))
    return {n: statistics.median(ts) for n, ts in per_round.items()}


def predict(world: int, step_s: float) -> dict[str, float]:
    """Predicted step seconds per planner strategy at ``world`` ranks on this host, calibrated on ``step_s``."""
    plan = make_plan(model="strategies:build_model", input_spec="784", gpu="cpu", gpus=world, precision="fp32",
                     optimizer="adam", micro_batch=GLOBAL, global_batch=GLOBAL, micro_batches=8, schedule="1f1b",
                     step_time=step_s)
    return {e.name: e.time.step_s for e in plan.estimates}


def row(world: int, strategy: str, predicted_s: float, measured_s: float) -> dict[str, object]:
    error = predicted_s / measured_s - 1
    return {"world": world, "strategy": strategy, "predicted_ms": 1e3 * predicted_s, "measured_ms": 1e3 * measured_s,
            "error": error, "within_target": abs(error) <= TARGET}


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
    print(f"paratrain {paratrain.__version__}, torch {torch.__version__}, {CORES} cores, gloo; "
          f"MLP 784-{strategies.MODEL_WIDTH}x4-10, Adam, fp32, global batch {GLOBAL}; {rounds} round(s) x {steps} "
          f"timed steps")

    single, wall, share = audited(lambda: measure_single(rounds, steps, a.warmup))
    calibration_s = single[default_threads]
    print(f"world 1: {1e3 * calibration_s:.1f} ms/step at {default_threads} threads (calibrates the planner), "
          f"{1e3 * single[1]:.1f} ms at 1 thread; {load_note(wall, share)}")
    shares = {1: share}
    rows = [row(1, "single", predict(1, calibration_s)["single"], calibration_s)]
    for world in worlds:
        predicted = predict(world, calibration_s)
        labels = {name: PLANNER_TO_LABEL[name] for name in PLANNER_TO_LABEL if name in predicted}
        ranks, wall, shares[world] = audited(lambda: paratrain.launch(
            strategies.job, world, (list(labels.values()), rounds, steps, a.warmup), timeout_s=900))
        measured = {r["strategy"]: r["step_ms"] / 1e3 for r in strategies.summarise(world, ranks)}
        rows += [row(world, label, predicted[name], measured[label]) for name, label in labels.items()]
        print(f"world {world}: measured in {load_note(wall, shares[world])}")
    end, wall, share = audited(lambda: measure_single(1, steps, a.warmup))
    after = end[default_threads]
    print(f"world 1 again at the end: {1e3 * after:.1f} ms/step ({after / calibration_s - 1:+.1%} vs the "
          f"calibration); {load_note(wall, share)}")

    print(f"\n{'world':>5} {'strategy':<16} {'predicted ms':>12} {'measured ms':>11} {'error':>8}  within 20%?")
    for r in rows:
        verdict = "calibration" if r["world"] == 1 else ("yes" if r["within_target"] else "NO")
        print(f"{r['world']:>5} {r['strategy']:<16} {r['predicted_ms']:>12.1f} {r['measured_ms']:>11.1f} "
              f"{r['error']:>+8.1%}  {verdict}")
    checked = [r for r in rows if r["world"] > 1]
    print(f"within {TARGET:.0%}: {sum(r['within_target'] for r in checked)} of {len(checked)} cases")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"single_thread_ms": 1e3 * single[1], "default_threads": default_threads,
                       "calibration_ms": 1e3 * calibration_s, "end_check_ms": 1e3 * after,
                       "background_share": shares, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
