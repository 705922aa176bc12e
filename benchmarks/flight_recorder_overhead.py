"""What torch's flight recorder (on by default in ``paratrain run``'s workers) costs a training step, on CPU/gloo.

The recorder is a per-process setting read when the first process group starts, so "on" and "off" are separate
jobs: each round launches one job of 2 processes (1 thread each) with ``TORCH_FR_BUFFER_SIZE=2000`` (paratrain
run's default) and one without, in an order flipped every round. Each job trains the MLP 784-1024-1024-10 (batch
64 per rank, ``Parallel(strategy)``, an in-memory prepared loader) for a warm-up pass and then a timed pass; rank
0's wall time per step is the job's figure. Reported per strategy: the median of the per-round ratios on/off
(target <= 1.01), and how many collectives a step records (zero3 all-gathers and reduce-scatters per layer).

On a busy machine the end-to-end ratio is noise (±10% between rounds); the second part measures the cost itself:
one process on a world-1 gloo group runs loops of 2000 one-number all-reduces, recorder on and off in alternate
processes, this thread's CPU time (``time.thread_time``), the fastest loop of each (as ``timeit`` does). Its
difference, in microseconds per collective, times the collectives of a step, divided by part 1's step time, is
the recorder's share of a step.

Run (about 2 minutes on 2 cores):
    .venv/bin/python benchmarks/flight_recorder_overhead.py [--rounds 7] [--steps 60] [--strategies ddp,zero3]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import time

import torch
import torch.nn.functional as F
from ddp_overhead import CORES, audited, background_line
from torch.utils.data import DataLoader, TensorDataset

import paratrain
from paratrain.hang_trace import BUFFER_VAR, DEFAULT_BUFFER_SIZE
from paratrain.workloads.synthetic import mlp

BATCH_PER_RANK = 64
TARGET = 0.01


def job(strategy: str, steps: int) -> tuple[float, int]:
    """Seconds per step of a timed pass after a warm-up pass, and the collectives one step recorded."""
    par = paratrain.Parallel(strategy, monitor=False)
    torch.manual_seed(0)
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(par.rank)
    n = BATCH_PER_RANK * par.world_size * steps
    data = TensorDataset(torch.randn(n, 784, generator=g), torch.randint(0, 10, (n,), generator=g))
    model, optimizer, loader = par.prepare(model, optimizer, DataLoader(data, batch_size=BATCH_PER_RANK))

    def one_pass() -> float:
        par.barrier()
        t0 = time.perf_counter()
        for x, y in loader:
            with par.step(model, optimizer):
                par.backward(F.cross_entropy(model(x), y))
        return (time.perf_counter() - t0) / len(loader)

    one_pass()
    before = _recorded()
    seconds = one_pass()
    per_step = (_recorded() - before) // len(loader)
    par.close()
    return seconds, per_step


def _recorded() -> int:
    """Collectives this process's recorder holds (0 when it is off)."""
    entries = pickle.loads(torch._C._distributed_c10d._dump_fr_trace(includeStackTraces=False))["entries"]
    return entries[-1]["record_id"] + 1 if entries else 0


def collective_loop(loops: int, n: int) -> list[float]:
    """Seconds of this thread's CPU time per one-number all-reduce, for each of ``loops`` loops of ``n``."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.ones(1)
    times = []
    for _ in range(loops):
        t0 = time.thread_time()
        for _ in range(n):
            dist.all_reduce(t)
        times.append((time.thread_time() - t0) / n)
    dist.destroy_process_group()
    return times


def bench_record(rounds: int) -> dict:
    """Microseconds the recorder adds to one collective: fastest loop on minus fastest loop off."""
    times: dict[str, list[float]] = {"off": [], "on": []}
    for r in range(rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            env = {BUFFER_VAR: str(DEFAULT_BUFFER_SIZE) if name == "on" else "0"}
            times[name] += paratrain.launch(collective_loop, 1, args=(5, 2000), threads=1, timeout_s=600, env=env)[0]
    return {
        "us_per_collective": 1e6 * (min(times["on"]) - min(times["off"])),
        "loop_us": {k: [1e6 * t for t in v] for k, v in times.items()},
    }


def bench(strategy: str, rounds: int, steps: int) -> dict:
    times: dict[str, list[float]] = {"off": [], "on": []}
    recorded = 0
    for r in range(rounds):
        for name in ("off", "on") if r % 2 == 0 else ("on", "off"):
            env = {BUFFER_VAR: str(DEFAULT_BUFFER_SIZE) if name == "on" else "0"}
            seconds, per_step = paratrain.launch(job, 2, args=(strategy, steps), threads=1, timeout_s=600, env=env)[0]
            times[name].append(seconds)
            recorded = max(recorded, per_step)
    ratios = [on / off for on, off in zip(times["on"], times["off"])]
    return {
        "per_round_ms": {k: [1e3 * t for t in v] for k, v in times.items()},
        "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
        "median_round_ratio": statistics.median(ratios),
        "collectives_per_step": recorded,
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=60, help="steps per timed pass")
    p.add_argument("--strategies", default="ddp,zero3")
    p.add_argument("--json", help="write every number here")
    args = p.parse_args(argv)
    print(
        f"paratrain {paratrain.__version__}, torch {torch.__version__}, {CORES} cores, gloo; MLP 784-1024-1024-10, "
        f"batch {BATCH_PER_RANK}/rank, world 2, {BUFFER_VAR}={DEFAULT_BUFFER_SIZE} vs 0, rounds={args.rounds} "
        f"steps={args.steps}"
    )
    result = {}
    for strategy in args.strategies.split(","):
        r = result[strategy] = audited(lambda s=strategy: bench(s, args.rounds, args.steps))
        print(f"{strategy}: ms per step (rank 0), {r['collectives_per_step']} collectives recorded per step")
        print(f"   {'round':<8}{'off':>9}{'on':>9}{'ratio':>9}")
        per = r["per_round_ms"]
        for i, (off, on) in enumerate(zip(per["off"], per["on"]), 1):
            print(f"   {i:<8}{off:>9.2f}{on:>9.2f}{on / off:>9.3f}")
        ratio = r["median_round_ratio"]
        print(
            f"   median   {r['median_ms']['off']:>8.2f}{r['median_ms']['on']:>9.2f}{ratio:>9.3f}   (median of the "
            f"per-round ratios; target <= {1 + TARGET:.2f}: {'met' if ratio <= 1 + TARGET else 'MISSED'})"
        )
        print(background_line(r))
    record = result["record"] = audited(lambda: bench_record(args.rounds))
    us = record["us_per_collective"]
    print(
        f"Per collective: the recorder adds {us:.1f} us (fastest loop on {min(record['loop_us']['on']):.1f} us, "
        f"off {min(record['loop_us']['off']):.1f} us)"
    )
    for strategy in args.strategies.split(","):
        r = result[strategy]
        share = us * r["collectives_per_step"] / 1e3 / r["median_ms"]["off"]
        r["record_share"] = share
        print(
            f"   {strategy}: {r['collectives_per_step']} x {us:.1f} us of a {r['median_ms']['off']:.2f} ms step = "
            f"{share:.3%} (target <= {TARGET:.0%}: {'met' if share <= TARGET else 'MISSED'})"
        )
    print(background_line(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
