"""The planner against published large runs (benchmarks/RESULTS.md §19): each run of ``planner.published.RUNS``
planned with its published layout, setup and hardware, predicted against published step time and memory; with
--counts, the mixture-of-experts presets' parameter counts against their published ones (§19b).

    PYTHONPATH=src python benchmarks/planner_published.py [--json out.json] [--counts]

Pure arithmetic (milliseconds, no GPU): prints the markdown table of §19 (or §19b) and, with --json, the figures.
"""

from __future__ import annotations

import argparse
import json

from paratrain.planner.published import MOE_COUNTS, RUNS, predict, preset_counts

STEP_BOUND, MEMORY_BOUND = 0.20, 0.15


def _layout(run) -> str:
    parts = [f"dp {run.dp}" + (f" (zero{run.zero})" if run.zero else "")]
    parts += [f"{k} {v}" for k, v in (("pp", run.pp), ("tp", run.tp)) if v > 1]
    if run.pp > 1:
        parts.append(run.schedule + (f" v={run.virtual_stages}" if run.virtual_stages else ""))
    return " x ".join(parts[:3]) + (f", {parts[3]}" if len(parts) > 3 else "")


def rows() -> list[dict]:
    out = []
    for run in RUNS:
        p = predict(run)
        t = p.estimate.time
        out.append(
            {
                "name": run.name,
                "source": run.source,
                "gpus": run.world_size,
                "gpu": run.gpu,
                "layout": _layout(run),
                "micro_batch": run.micro_batch,
                "global_batch": run.global_batch,
                "seq_len": run.model.seq_len,
                "recompute": run.recompute,
                "sequence_parallel": run.sequence_parallel,
                "published_step_s": run.step_s,
                "predicted_step_s": p.step_s,
                "step_ratio": p.step_ratio,
                "published_memory_gib": run.memory_gib,
                "memory_kind": run.memory_kind,
                "predicted_memory_gib": p.memory_gib,
                "memory_ratio": p.memory_ratio,
                "compute_s": t.compute_s,
                "bubble_s": t.bubble_s,
                "exposed_comm_s": t.exposed_comm_s,
                "tp_comm_s": t.tp_comm_s,
                "caveat": run.caveat,
                "assumed": run.assumed,
            }
        )
    return out


def table(data: list[dict]) -> str:
    lines = [
        "| run | GPUs | layout | batch (micro / global) | recompute | step s published | predicted | ratio | "
        "memory GiB published | predicted | ratio | in bounds |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data:
        mem_in = r["memory_ratio"] is None or abs(r["memory_ratio"] - 1) <= MEMORY_BOUND
        ok = abs(r["step_ratio"] - 1) <= STEP_BOUND and mem_in
        mem = (
            f"{r['published_memory_gib']:.1f} ({r['memory_kind']}) | {r['predicted_memory_gib']:.1f} | "
            f"{r['memory_ratio']:.2f}"
            if r["published_memory_gib"]
            else f"— | {r['predicted_memory_gib']:.1f} | —"
        )
        recompute = r["recompute"] + (" + sp" if r["sequence_parallel"] and "tp" in r["layout"] else "")
        lines.append(
            f"| {r['name']} | {r['gpus']} {r['gpu']} | {r['layout']} | {r['micro_batch']} / "
            f"{r['global_batch']} | {recompute} | {r['published_step_s']:.2f} | {r['predicted_step_s']:.2f} | "
            f"{r['step_ratio']:.2f} | {mem} | {'yes' if ok else 'no'} |"
        )
    return "\n".join(lines)


def counts() -> str:
    """The MoE presets' total and active parameters against the published counts (§19b)."""
    lines = ["| preset | total | published | ratio | active | published | ratio |", "|---|---|---|---|---|---|---|"]
    for name, published in MOE_COUNTS.items():
        total, active = preset_counts(name)
        note = " (without the embedding lookups)" if published.active_without_lookups else ""
        lines.append(
            f"| {name} | {total / 1e9:.2f}B | {published.total / 1e9:.2f}B | {total / published.total:.3f} | "
            f"{active / 1e9:.2f}B{note} | {published.active / 1e9:.2f}B | {active / published.active:.3f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--counts", action="store_true", help="the MoE presets' parameter counts (§19b)")
    args = parser.parse_args()
    if args.counts:
        print(counts())
        return
    data = rows()
    print(table(data))
    for r in data:
        if r["caveat"]:
            print(f"- {r['name']}: {r['caveat']}")
    for run in RUNS:
        if run.assumed:
            print(f"- {run.name} assumes: {run.assumed}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(data, f, indent=1)


if __name__ == "__main__":
    main()
