"""Every strategy side by side on one model: step time, per-rank state memory and samples/s (CPU, gloo).

    .venv/bin/python benchmarks/strategies.py                 # world 2 and 4, 3 interleaved rounds
    .venv/bin/python benchmarks/strategies.py --quick         # world 2, 1 round, fewer steps
    .venv/bin/python benchmarks/strategies.py --json out.json

One job per world size runs every strategy in the same processes, round after round (strategy order
rotates each round), so all strategies see the same machine conditions. The global batch is fixed (strong
scaling): each data-parallel replica reads global / replicas samples per step. Step time is the median over
rounds of each round's median, taken on the slowest rank; "state" is the parameter + gradient + Adam-state
bytes this rank holds, counted from its local tensors (shards for zero/fsdp, its stages for pipelines).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import paratrain
from paratrain.distributed.process_group import finish_group

MODEL_WIDTH, GLOBAL_BATCH = 1024, 128
STRATEGIES: dict[str, tuple[str, dict]] = {  # label -> (strategy, options)
    "ddp": ("ddp", {}),
    "zero1": ("zero1", {}),
    "zero2": ("zero2", {"min_params": 100_000}),
    "zero3": ("zero3", {"min_params": 100_000}),
    "hsdp": ("hsdp", {"min_params": 100_000}),
    "pipeline-gpipe-8": ("pipeline", {"schedule": "gpipe", "microbatches": 8}),
    "pipeline-1f1b-8": ("pipeline", {"schedule": "1f1b", "microbatches": 8}),
    "hybrid": ("hybrid", {"microbatches": 4}),
    "model_parallel": ("model_parallel", {}),
}
NEEDS_4 = {"hsdp", "hybrid"}


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    w = MODEL_WIDTH
    return nn.Sequential(
        nn.Linear(784, w),
        nn.ReLU(),
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, w),
        nn.ReLU(),
        nn.Linear(w, 10),
    )


def _local_bytes(t: torch.Tensor) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def measure(label: str, steps: int, warmup: int) -> dict[str, object]:
    """Time ``steps`` optimizer steps of one strategy on this rank; count its state bytes."""
    strategy, options = STRATEGIES[label]
    par = paratrain.Parallel(strategy, **options)  # reuses the job's process group
    model = build_model()
    model, opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    batch = GLOBAL_BATCH // par.data_parallel_size
    g = torch.Generator().manual_seed(par.data_parallel_rank)
    x, y = torch.randn(batch, 784, generator=g), torch.randint(0, 10, (batch,), generator=g)
    times, grads = [], 0
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        with par.step(model, opt):
            par.forward_backward(model, x, y, nn.functional.cross_entropy)
            if i == 0:
                grads = sum(_local_bytes(p.grad) for p in model.parameters() if p.grad is not None)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    inner = getattr(opt, "optim", opt)
    state = (
        sum(_local_bytes(p) for p in model.parameters())
        + grads
        + sum(
            _local_bytes(v)
            for s in inner.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        )
    )
    return {"median_s": statistics.median(times), "state_bytes": state}


def job(labels: list[str], rounds: int, steps: int, warmup: int) -> dict[str, list[dict]]:
    """One rank's results: per strategy, one entry per round."""
    dist.init_process_group("gloo")
    out = run_rounds(labels, rounds, steps, warmup)
    finish_group()
    return out


def run_rounds(labels: list[str], rounds: int, steps: int, warmup: int) -> dict[str, list[dict]]:
    """Every strategy once per round, the order rotating each round (inside a started process group)."""
    out: dict[str, list[dict]] = {label: [] for label in labels}
    for r in range(rounds):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for label in order:
            out[label].append(measure(label, steps, warmup))
    return out


def summarise(world: int, ranks: list[dict[str, list[dict]]]) -> list[dict[str, object]]:
    rows = []
    for label in ranks[0]:
        per_round = [max(rank[label][r]["median_s"] for rank in ranks) for r in range(len(ranks[0][label]))]
        step = statistics.median(per_round)
        rows.append(
            {
                "world": world,
                "strategy": label,
                "step_ms": 1e3 * step,
                "samples_per_s": GLOBAL_BATCH / step,
                "state_mb": max(rank[label][0]["state_bytes"] for rank in ranks) / 2**20,
                "rounds_ms": [round(1e3 * t, 2) for t in per_round],
            }
        )
    ddp = next(r for r in rows if r["strategy"] == "ddp")
    for row in rows:
        row["step_vs_ddp"] = row["step_ms"] / ddp["step_ms"]
        row["state_vs_ddp"] = row["state_mb"] / ddp["state_mb"]
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="world 2, 1 round, 5 steps")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    worlds = [2] if a.quick else [int(w) for w in a.worlds.split(",")]
    rounds, steps = (1, 5) if a.quick else (a.rounds, a.steps)
    params = sum(p.numel() for p in build_model().parameters())
    print(
        f"model: MLP 784-{MODEL_WIDTH}x4-10, {params / 1e6:.2f}M parameters, Adam, fp32; "
        f"global batch {GLOBAL_BATCH}; {rounds} round(s) x {steps} timed steps"
    )
    rows = []
    for world in worlds:
        labels = [s for s in STRATEGIES if world >= 4 or s not in NEEDS_4]
        started = time.perf_counter()
        ranks = paratrain.launch(job, world, (labels, rounds, steps, a.warmup), timeout_s=900)
        rows += summarise(world, ranks)
        print(f"world {world}: measured in {time.perf_counter() - started:.0f} s")
    print(
        f"\n{'world':>5} {'strategy':<18} {'step ms':>9} {'x ddp':>6} {'samples/s':>10} {'state MiB/rank':>15} "
        f"{'x ddp':>6}"
    )
    for r in rows:
        print(
            f"{r['world']:>5} {r['strategy']:<18} {r['step_ms']:>9.1f} {r['step_vs_ddp']:>6.2f} "
            f"{r['samples_per_s']:>10.0f} {r['state_mb']:>15.2f} {r['state_vs_ddp']:>6.3f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
