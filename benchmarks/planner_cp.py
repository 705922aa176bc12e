"""Llama 3 8B at 32768 tokens a sample on one node of 8 H100s, planned with context parallelism
(benchmarks/RESULTS.md §32): which layouts fit, which need cp, and what the cp rows cost the planner itself.

    PYTHONPATH=src python benchmarks/planner_cp.py [--json out.json] [--rounds 7]

The plan is ``paratrain plan --model llama3-8b --gpus 8 --seq-len 32768 --batch 1 --ps-servers 0`` (arithmetic: no
GPU is used). Its time to plan, with the cp rows (the default search) and without them (``--cp 1``), is measured in
interleaved rounds in this process after one warm-up each; medians and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

from paratrain.planner import (
    TRANSFORMERS,
    PlanConfig,
    Training,
    make_plan,
    transformer_stats,
)
from paratrain.planner.hardware import GIB

STATS = transformer_stats(replace(TRANSFORMERS["llama3-8b"], seq_len=32768), name="llama3-8b")
CONFIG = PlanConfig(gpus=8, ps_servers=0, training=Training(micro_batch=1))


def rows() -> list[dict]:
    """Every row of the plan: its layout, whether it fits, memory, step time and cp's all-to-alls."""
    plan = make_plan(STATS, CONFIG)
    out = [
        {
            "strategy": e.name,
            "layout": e.layout.describe(),
            "cp": e.layout.cp,
            "fits": e.fits,
            "gib_per_gpu": e.memory.total / GIB,
            "step_ms": e.time.step_s * 1e3,
            "cp_all_to_all_ms": e.time.cp_comm_s * 1e3,
        }
        for e in plan.estimates
    ]
    choice = plan.choice
    return out + [
        {
            "recommended": choice.name,
            "layout": choice.layout.describe(),
            "reason": plan.reason,
            "checkpointing": choice.checkpointing,
            "notes": list(plan.notes),
        }
    ]


def planning_time(rounds: int) -> dict[str, float]:
    """Median seconds to plan with and without the cp rows, interleaved."""
    variants = {"with cp rows": CONFIG, "without (--cp 1)": replace(CONFIG, cp=1)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for config in variants.values():
        make_plan(STATS, config)  # warm-up
    for _ in range(rounds):
        for name, config in variants.items():
            start = time.perf_counter()
            make_plan(STATS, config)
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(t) for name, t in times.items()}
    return medians | {"ratio": medians["with cp rows"] / medians["without (--cp 1)"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows and timings here")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    result = {"rows": rows(), "planning_s": planning_time(args.rounds), "rounds": args.rounds}
    for row in result["rows"][:-1]:
        print(
            f"{row['strategy']:<16} {row['layout']:<24} {'yes' if row['fits'] else 'no':<4} "
            f"{row['gib_per_gpu']:>7.1f} GiB {row['step_ms']:>8.1f} ms  cp a2a {row['cp_all_to_all_ms']:>6.1f} ms"
        )
    print(json.dumps(result["rows"][-1], indent=1))
    print(json.dumps(result["planning_s"], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
