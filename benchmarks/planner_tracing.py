"""nanoGPT's model planned as its users plan it (benchmarks/RESULTS.md §21): ``paratrain plan --model module:factory``
traces the forward as training calls it (with targets) and as ``model(x)`` calls it (nanoGPT's generation path),
against the closed forms of the same shape and a real training step on this CPU.

    PYTHONPATH=src python benchmarks/planner_tracing.py [--json out.json]

The model is tests/helpers/nanogpt_shaped.py's, in the shape of karpathy/nanoGPT's ``model.py`` (GPT-2 124M, vocabulary
50304, 1024 tokens). Prints FLOPs and activations (fp32) per sample, and the one-GPU row of nanoGPT's own run: 480
samples a step in micro-batches of 12 on 8 A100 80GB, in fp32 and bf16-mixed. The CPU step (one sample, ~15 s on 2
cores) is the slow part.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.nanogpt_shaped import gpt2  # noqa: E402

from paratrain.planner import (  # noqa: E402
    InputSpec,
    ModelStats,
    PlanConfig,
    RunnableModel,
    Training,
    TrainingCall,
    make_plan,
    measure_module,
    trace_module,
    transformer_stats,
)
from paratrain.planner.hardware import GIB  # noqa: E402
from paratrain.workloads.gpt import GPT_CONFIGS  # noqa: E402

TOKENS = InputSpec.parse("long:1024")
RUN = PlanConfig(gpu="a100-80gb", gpus=8, training=Training(micro_batch=12, global_batch=480))


def _one_gpu(model: ModelStats | RunnableModel) -> dict[str, float]:
    """The one-GPU row of nanoGPT's run in fp32 and under bf16-mixed (where a traced model's activations are half its
    fp32 ones: the closed forms know which tensors autocast keeps in fp32)."""
    out = {}
    for precision in ("fp32", "bf16-mixed"):
        single = make_plan(model, replace(RUN, training=replace(RUN.training, precision=precision))).estimates[0]
        out |= {
            f"one_gpu_gib_{precision}": single.memory.total / GIB,
            f"one_gpu_step_s_{precision}": single.time.step_s,
        }
    return out


def rows() -> list[dict]:
    closed = transformer_stats(replace(GPT_CONFIGS["gpt2"], vocab=50304), name="closed form")
    cases = [
        ("closed forms", closed, closed),
        (
            "traced as training calls it (targets)",
            trace_module(gpt2, TOKENS, name="nanogpt"),
            RunnableModel(name="nanogpt", factory=gpt2, call=TrainingCall(input=TOKENS)),
        ),
        (
            "traced as model(x) calls it",
            trace_module(gpt2, TrainingCall(input=TOKENS, plain=True), name="nanogpt"),
            RunnableModel(name="nanogpt", factory=gpt2, call=TrainingCall(input=TOKENS, plain=True)),
        ),
        ("measured: a CPU training step", measure_module(gpt2, TOKENS, name="nanogpt", batch=1, steps=1), None),
    ]
    out = []
    for name, stats, planned in cases:
        row = {
            "case": name,
            "gflop_per_sample": stats.flops_per_sample / 1e9,
            "activation_mib_per_sample_fp32": stats.activation_bytes_per_sample / 2**20,
            "flops_vs_closed": stats.flops_per_sample / closed.flops_per_sample,
            "activations_vs_closed": stats.activation_bytes_per_sample / closed.activation_bytes_per_sample,
            "warnings": list(stats.warnings),
        }
        out.append(row | (_one_gpu(planned) if planned is not None else {}))
    return out


def table(found: list[dict]) -> str:
    lines = [
        "| case | GFLOP a sample | vs closed | activations MiB a sample (fp32) | vs closed | one A100, fp32: GiB "
        "| step s | bf16-mixed: GiB | step s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in found:
        gpu = " | ".join(
            f"{r[f'one_gpu_gib_{p}']:.1f} | {r[f'one_gpu_step_s_{p}']:.2f}" if "one_gpu_gib_fp32" in r else "— | —"
            for p in ("fp32", "bf16-mixed")
        )
        lines.append(
            f"| {r['case']} | {r['gflop_per_sample']:.1f} | {r['flops_vs_closed']:.3f} | "
            f"{r['activation_mib_per_sample_fp32']:.1f} | {r['activations_vs_closed']:.3f} | {gpu} |"
        )
    return "\n".join(lines + [f"- warning ({r['case']}): {w}" for r in found for w in r["warnings"]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    found = rows()
    print(table(found))
    if args.json:
        Path(args.json).write_text(json.dumps(found, indent=2) + "\n")


if __name__ == "__main__":
    main()
