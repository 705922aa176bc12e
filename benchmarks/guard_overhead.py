"""What the numerics guard costs on a training step, on CPU/gloo, measured two ways.

1. End to end, world size 2: one job of 2 processes (1 thread each) holds two ``Parallel("ddp", monitor=False)``
   objects on one shared gloo group, one with ``guard=False``, one with ``guard=True`` (or ``--spike``:
   ``GuardConfig(spike=10)``), each with its own copy of the same MLP, AdamW and an in-memory batch list. Timed
   blocks of N steps alternate between them, the order flipped every round; rank 0's wall time per step is
   reported, and the median of the per-round ratios on/off. Nothing is wrong in the data, so the guard only
   decides: the global gradient norm (no collective under DDP, whose gradients are already averaged), the step's
   loss averaged over the ranks (one all-reduce of one number) and one host read of the flag.
2. The same step in one process (``Parallel("single")``: no all-reduce), in this thread's CPU time
   (``time.thread_time``, which other processes taking the cores inflate less than wall time); three times as many
   rounds, loops alternating; the median of the per-round ratios, and the fastest loop of each kind (as ``timeit``
   takes it). Less noisy than part 1 on a shared machine.

On a GPU the read is the cost to watch: the host waits for the backward before it queues the optimizer step. This
CPU run cannot show that; it shows the rest.

Run (about 1 minute on 2 cores):
    .venv/bin/python benchmarks/guard_overhead.py [--rounds 9] [--steps 50] [--spike] [--clip 1.0] [--quick] [--json P]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_overhead import CORES, audited, background_line
from torch import nn

import paratrain
from paratrain.distributed.process_group import finish_group
from paratrain.workloads.synthetic import mlp

BATCH_PER_RANK = 64


def _job(guard: bool | paratrain.GuardConfig, steps: int, clip: float | None, strategy: str = "ddp") -> tuple:
    par = paratrain.Parallel(strategy, monitor=False, guard=guard, clip_grad_norm=clip)
    torch.manual_seed(0)
    model = mlp()
    model, optimizer = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    g = torch.Generator().manual_seed(par.rank)
    data = [
        (torch.randn(BATCH_PER_RANK, 784, generator=g), torch.randint(0, 10, (BATCH_PER_RANK,))) for _ in range(steps)
    ]
    return par, model, optimizer, data


def _block(
    par: paratrain.Parallel,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Seconds per step over ``data``."""
    if dist.is_initialized():
        dist.barrier()
    t0 = clock()
    for x, y in data:
        with par.step(model, optimizer):
            par.forward_backward(model, x, y, F.cross_entropy)
    return (clock() - t0) / len(data)


def worker(rounds: int, steps: int, spike: bool, clip: float | None) -> dict[str, list[float]]:
    dist.init_process_group("gloo")
    on = paratrain.GuardConfig(spike=10.0) if spike else True
    jobs = {"off": _job(False, steps, clip), "on": _job(on, steps, clip)}
    for job in jobs.values():
        _block(*job)  # warm-up pass
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            times[name].append(_block(*jobs[name]))
    for par, *_ in jobs.values():
        par.close()
    finish_group()
    return times


def bench(rounds: int, steps: int, spike: bool, clip: float | None) -> dict:
    times = paratrain.launch(worker, 2, args=(rounds, steps, spike, clip), threads=1, timeout_s=900)[0]
    ratios = [on / off for on, off in zip(times["on"], times["off"])]
    return {
        "per_round_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "median_round_ratio": statistics.median(ratios),
    }


def bench_one_process(rounds: int, steps: int, spike: bool, clip: float | None) -> dict:
    torch.set_num_threads(1)
    on = paratrain.GuardConfig(spike=10.0) if spike else True
    jobs = {"off": _job(False, steps, clip, "single"), "on": _job(on, steps, clip, "single")}
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds + 1):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            t = _block(*jobs[name], clock=time.thread_time)
            if r:  # the first round warms up
                times[name].append(t)
    for par, *_ in jobs.values():
        par.close()
    return {
        "loop_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
        "fastest_ms": {k: 1e3 * min(v) for k, v in times.items()},
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "median_round_ratio": statistics.median(on / off for on, off in zip(times["on"], times["off"])),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=50, help="steps per timed block")
    p.add_argument("--spike", action="store_true", help="guard=GuardConfig(spike=10): the loss median too")
    p.add_argument("--clip", type=float, help="clip_grad_norm in both runs (then the norm is taken anyway)")
    p.add_argument("--quick", action="store_true", help="3 rounds of 10 steps: checks that it runs, measures little")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    rounds, steps = (3, 10) if args.quick else (args.rounds, args.steps)
    result = audited(lambda: bench(rounds, steps, args.spike, args.clip))
    alone = audited(lambda: bench_one_process(3 * rounds, steps, args.spike, args.clip))
    print(
        f"paratrain {paratrain.__version__}, torch {torch.__version__}, {CORES} cores, gloo; MLP 784-1024-1024-10, "
        f"AdamW, batch {BATCH_PER_RANK}/rank, world 2, ddp, guard={'GuardConfig(spike=10)' if args.spike else True}, "
        f"clip_grad_norm={args.clip}, rounds={rounds} steps={steps}"
    )
    print("1. End to end, world 2")
    print(f"   {'round':<8}{'off':>9}{'on':>9}{'ratio':>9}   (ms per step, rank 0)")
    per = result["per_round_ms"]
    for i, (off, on) in enumerate(zip(per["off"], per["on"]), 1):
        print(f"   {i:<8}{off:>9.2f}{on:>9.2f}{on / off:>9.3f}")
    median = result["median_ms"]
    print(
        f"   median   {median['off']:>8.2f}{median['on']:>9.2f}{result['median_round_ratio']:>9.3f}   "
        "(median of the per-round ratios)"
    )
    print(background_line(result))
    fastest, median = alone["fastest_ms"], alone["median_ms"]
    print(
        f"2. One process, {3 * rounds} rounds, thread CPU ms per step: median off {median['off']:.2f}, on "
        f"{median['on']:.2f}, median of the per-round ratios {alone['median_round_ratio']:.3f}; fastest off "
        f"{fastest['off']:.2f}, on {fastest['on']:.2f}"
    )
    print(background_line(alone))
    out = {"end_to_end": result, "one_process": alone}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
