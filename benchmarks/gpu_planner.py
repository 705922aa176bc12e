"""The planner on the real device: planned against measured step time and memory of GPT-2 124M/355M on one GPU.

    python3 benchmarks/gpu_planner.py                       # gpt2 and gpt2-medium, batches 2, 4, 8
    python3 benchmarks/gpu_planner.py --json planner-gpu.json

For each model, ``PlanConfig(measure=True)`` first times a few real steps at ``--calibrate-at`` sequences on
this GPU (``paratrain plan --measure``), which sets the GPU's MFU and memory bandwidth. Then, at each batch
size, four figures of the single-GPU step (bf16-mixed, AdamW): the plan with the catalogue's MFU (0.4), the
plan calibrated at the one batch size, the plan calibrated at this batch size (what ``paratrain plan --measure
--batch B`` gives), and the measurement: ``Parallel("single", precision="bf16-mixed")``
training the model (cross-entropy, ``forward_backward``), the median of ``--steps`` steps after 3 of warm-up,
and ``max_memory_allocated`` over them less what was allocated before the model was built. Memory is the
plan's ``allocated`` (the peak without the CUDA context and allocator slack, which the allocator's statistics
do not see). Targets (issue #13): time within 20%, memory within 10%. Then the same with every block
checkpointed (``activation_checkpointing=True`` against the plan's ``--checkpointing``).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch
from torch.nn import functional as F

import paratrain
from paratrain.errors import ConfigError
from paratrain.planner import PlanConfig, Training, make_plan
from paratrain.planner.gpu_step import check_same_gpu
from paratrain.planner.hardware import DEVICES
from paratrain.workloads.gpt import GPT, GPT_CONFIGS
from paratrain.workloads.model_names import resolve_model


def catalogue_name() -> str:
    """The planner's name for the GPU this runs on."""
    name = torch.cuda.get_device_name()
    for device in DEVICES.values():
        try:
            check_same_gpu(device, name)
            return device.name
        except ConfigError:
            continue
    raise SystemExit(f"{name} is not in the planner's catalogue")


def single_estimate(plan) -> object:
    return next(e for e in plan.estimates if e.layout.name == "single")


def bf16(batch: int, checkpointing: bool = False) -> Training:
    """The measured run's setup: bf16-mixed, AdamW, ``batch`` sequences."""
    return Training(precision="bf16-mixed", micro_batch=batch, checkpointing=checkpointing)


def measured(model: str, batch: int, steps: int, checkpointing: bool = False) -> tuple[float, float]:
    """(median step seconds, peak bytes) of ``Parallel('single')`` training ``model`` at ``batch``."""
    cfg = GPT_CONFIGS[model]
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    par = paratrain.Parallel(
        "single",
        precision="bf16-mixed",
        monitor=False,
        model=paratrain.ModelConfig(activation_checkpointing=checkpointing),
    )
    torch.manual_seed(0)
    net = GPT(cfg)
    net, opt = par.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-4))
    ids = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), device=par.device)
    x, y = ids[:, :-1], ids[:, 1:]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    times = []
    for i in range(3 + steps):
        if i == 3:
            torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        start = time.perf_counter()
        with par.step(net, opt):
            par.forward_backward(net, x, y, loss_fn)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() - before
    par.close()
    del net, opt, par
    return statistics.median(times), peak


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="gpt2,gpt2-medium")
    p.add_argument("--batches", default="2,4,8")
    p.add_argument("--calibrate-at", type=int, default=4, help="sequences of the calibrating measurement")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--json", help="write every row here")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a GPU")
    torch.backends.cuda.matmul.allow_tf32 = True
    gpu = catalogue_name()
    rows = []
    print(
        f"{torch.cuda.get_device_name()} as the planner's {gpu}; torch {torch.__version__}; single GPU, bf16-mixed, "
        f"AdamW; calibrated at batch {a.calibrate_at}"
    )
    print(
        f"{'model':<12} {'batch':>5} {'measured ms':>11} {'plan ms':>8} {'err':>6} {'calibrated':>10} {'err':>6} "
        f"{'at batch':>8} {'err':>6} {'measured GiB':>12} {'plan GiB':>8} {'err':>6}"
    )
    for model in a.models.split(","):
        planned = resolve_model(model)
        calibration = make_plan(planned, PlanConfig(gpu=gpu, measure=True, training=bf16(a.calibrate_at)))
        device = calibration.cluster.device
        for batch in (int(b) for b in a.batches.split(",")):
            plain = single_estimate(make_plan(planned, PlanConfig(gpu=gpu, training=bf16(batch))))
            tuned = single_estimate(
                make_plan(
                    planned, PlanConfig(gpu=gpu, training=bf16(batch), mfu=device.mfu, mem_bw_gbs=device.memory_gbs)
                )
            )
            here = make_plan(planned, PlanConfig(gpu=gpu, measure=True, training=bf16(batch)))
            step_s, peak = measured(model, batch, a.steps)
            row = {
                "model": model,
                "batch": batch,
                "measured_ms": 1e3 * step_s,
                "plan_ms": 1e3 * plain.time.step_s,
                "calibrated_ms": 1e3 * tuned.time.step_s,
                "calibrated_here_ms": 1e3 * single_estimate(here).time.step_s,
                "measured_gib": peak / 2**30,
                "plan_gib": tuned.memory.allocated / 2**30,
                "mfu": device.mfu,
                "memory_gbs": device.memory_gbs,
                "calibration_note": calibration.notes[-1],
            }
            rows.append(row)
            print(
                f"{model:<12} {batch:>5} {row['measured_ms']:>11.1f} {row['plan_ms']:>8.1f} "
                f"{row['plan_ms'] / row['measured_ms'] - 1:>+6.0%} {row['calibrated_ms']:>10.1f} "
                f"{row['calibrated_ms'] / row['measured_ms'] - 1:>+6.0%} {row['calibrated_here_ms']:>8.1f} "
                f"{row['calibrated_here_ms'] / row['measured_ms'] - 1:>+6.0%} {row['measured_gib']:>12.2f} "
                f"{row['plan_gib']:>8.2f} {row['plan_gib'] / row['measured_gib'] - 1:>+6.0%}",
                flush=True,
            )
        print(
            f"  {model}: calibrated MFU {device.mfu:.3f}, bandwidth {device.memory_gbs:.0f} GB/s; "
            f"{calibration.notes[-1]}"
        )
        for batch in (int(b) for b in a.batches.split(",")):  # every block checkpointed
            checkpointed = single_estimate(
                make_plan(
                    planned,
                    PlanConfig(
                        gpu=gpu, training=bf16(batch, checkpointing=True), mfu=device.mfu, mem_bw_gbs=device.memory_gbs
                    ),
                )
            )
            step_s, peak = measured(model, batch, a.steps, checkpointing=True)
            row = {
                "model": model,
                "batch": batch,
                "checkpointing": True,
                "measured_ms": 1e3 * step_s,
                "calibrated_ms": 1e3 * checkpointed.time.step_s,
                "measured_gib": peak / 2**30,
                "plan_gib": checkpointed.memory.allocated / 2**30,
            }
            rows.append(row)
            print(
                f"  checkpointed, batch {batch}: {row['measured_ms']:.1f} ms (plan calibrated at batch "
                f"{a.calibrate_at}: {row['calibrated_ms']:.1f}, {row['calibrated_ms'] / row['measured_ms'] - 1:+.0%})"
                f", {row['measured_gib']:.2f} GiB (plan {row['plan_gib']:.2f}, "
                f"{row['plan_gib'] / row['measured_gib'] - 1:+.0%})",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
