"""The planner's predicted memory per GPU against ``torch.cuda.max_memory_allocated``, one GPU, one process per case.

    PYTHONPATH=src python3 benchmarks/gpu_memory.py --json gpu_memory.json   # every case (a few minutes on an H100)
    PYTHONPATH=src python3 benchmarks/gpu_memory.py --quick                  # two models, one batch size each
    PYTHONPATH=src python3 benchmarks/gpu_memory.py --device cpu --models gpt-tiny   # check the cases run here
    PYTHONPATH=src python3 benchmarks/gpu_memory.py --dry-run                # anywhere: predictions and the case list

Cases: GPT-shaped transformers of 52M, 124M (gpt2) and 355M (gpt2-medium) parameters at sequence length 1024 and a
100M-parameter MLP, each trained with Adam as ``single`` in fp32 and in bf16-mixed (autocast) and as ``zero3``
(FSDP2, transformer blocks as units) at world size 1 over a one-rank NCCL group, in fp32 and bf16-mixed, at two
batch sizes. Each case runs in a fresh process (``paratrain.launch``, one rank): a small matrix product first
allocates cuBLAS's workspace, then the model is built, prepared and trained for ``--steps`` steps with the usual
``par.step`` loop; the peak is ``torch.cuda.max_memory_allocated()`` over the steps after the first (Adam's states
exist from then on), less what was allocated before the model was built.

Predicted is the planner's ``memory_per_rank(...).allocated``: everything but the fixed overhead (CUDA context,
allocator slack), which ``max_memory_allocated`` does not see. Error is predicted / measured - 1; the target is
|error| <= 15%. A case that runs out of memory is a result (its prediction should exceed the GPU), not a crash;
the exit status is nonzero only when a case fails otherwise. ``--device cpu`` runs the cases on this CPU to check
that they work (there is no allocator peak to compare on a CPU).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import paratrain
from paratrain.planner import (
    InputSpec,
    Layout,
    ModelStats,
    Training,
    batching,
    make_cluster,
    memory_per_rank,
    trace_module,
    transformer_stats,
)
from paratrain.workloads.gpt import GPT, GPT_CONFIGS, Block, GPTConfig

TARGET = 0.15
GIB = 2**30
GPTS = {
    "gpt-52m": GPTConfig(layers=8, hidden=512, heads=8),
    "gpt2": GPT_CONFIGS["gpt2"],
    "gpt2-medium": GPT_CONFIGS["gpt2-medium"],
    "gpt-tiny": GPT_CONFIGS["gpt-tiny"],
}
MLP_WIDTH, MLP_LAYERS = 4096, 6
BATCHES = {"gpt-52m": (2, 8), "gpt2": (2, 8), "gpt2-medium": (2, 8), "mlp-100m": (256, 8192), "gpt-tiny": (2, 8)}
"""Two batch sizes per model: the transformers peak when backward starts; the MLP's small batch peaks in the
optimizer step, its large one when backward starts."""
RUNS = (("single", "fp32"), ("single", "bf16-mixed"), ("zero3", "fp32"), ("zero3", "bf16-mixed"))


def mlp() -> nn.Module:
    """MLP_LAYERS square layers of MLP_WIDTH and a 10-way head: 100.7M parameters."""
    layers: list[nn.Module] = []
    for _ in range(MLP_LAYERS):
        layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(MLP_WIDTH, 10))


@dataclass(frozen=True)
class Case:
    model: str
    strategy: str
    precision: str
    batch: int

    @property
    def label(self) -> str:
        return f"{self.model} {self.strategy} {self.precision} b{self.batch}"


def cases(models: list[str], quick: bool) -> list[Case]:
    return [Case(m, s, p, b) for m in models for b in BATCHES[m][: 1 if quick else None] for s, p in RUNS]


@functools.cache
def model_stats(name: str) -> ModelStats:
    """The planner's statistics: closed forms for the transformers, a meta-device trace for the MLP."""
    if name in GPTS:
        return transformer_stats(GPTS[name], name=name)
    return trace_module(mlp, InputSpec(shape=(MLP_WIDTH,)), name=name)


def predict(case: Case) -> dict[str, Any]:
    """The planner's peak for ``case`` on one H100: bytes allocated, its breakdown and when it comes."""
    layout = Layout.of(name="zero3", zero=3) if case.strategy == "zero3" else Layout.of(name="single")
    training = Training(precision=case.precision, optimizer="adam", micro_batch=case.batch)
    memory = memory_per_rank(
        model_stats(case.model), layout, batching(training, dp=1, pp=1, world_size=1), training, make_cluster("h100")
    )
    return {
        "allocated": memory.allocated,
        "phase": memory.phase,
        "breakdown": {k: v for k, v in memory.as_dict().items() if k not in ("overhead", "total")},
    }


def _build(
    name: str,
) -> tuple[
    nn.Module,
    Callable[[int, torch.device], tuple[torch.Tensor, torch.Tensor]],
    Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
]:
    """Model, batch maker and loss of one case's model."""
    if name in GPTS:
        cfg = GPTS[name]

        def tokens(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
            ids = torch.randint(0, cfg.vocab, (batch, cfg.seq_len + 1), device=device)
            return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()

        def lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
            return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())

        return GPT(cfg), tokens, lm_loss

    def features(batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(batch, MLP_WIDTH, device=device), torch.randint(0, 10, (batch,), device=device)

    return mlp(), features, nn.functional.cross_entropy


def run_case(case: Case, steps: int, accelerator: str) -> dict[str, Any]:
    """One rank (inside ``paratrain.launch``): train ``case`` for ``steps`` steps; the peak bytes it allocated."""
    options = {"wrap_classes": (Block,)} if case.strategy == "zero3" and case.model in GPTS else {}
    par = paratrain.Parallel(case.strategy, precision=case.precision, accelerator=accelerator, monitor=False, **options)
    cuda = par.device.type == "cuda"
    try:
        if cuda:  # cuBLAS's workspace comes from the caching allocator: allocate it before the baseline
            for dtype in (torch.float32, torch.bfloat16):
                torch.ones(64, 64, device=par.device, dtype=dtype) @ torch.ones(64, 64, device=par.device, dtype=dtype)
            torch.cuda.synchronize()
        base = torch.cuda.memory_allocated(par.device) if cuda else 0
        model, make_batch, loss_fn = _build(case.model)
        model, opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4))
        x, y = make_batch(case.batch, par.device)
        for step in range(steps):
            if step == 1 and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(par.device)
            with par.step(model, opt):
                par.forward_backward(model, x, y, loss_fn)
        if not cuda:
            return {"measured": None}
        torch.cuda.synchronize()
        return {"measured": torch.cuda.max_memory_allocated(par.device) - base, "device": torch.cuda.get_device_name()}
    except torch.cuda.OutOfMemoryError as err:
        return {"measured": None, "oom": str(err).splitlines()[0]}
    finally:
        par.close()


def measure(case: Case, steps: int, accelerator: str) -> dict[str, Any]:
    """``run_case`` in a fresh process, so every case starts from an empty allocator; a failure is reported."""
    try:
        return paratrain.launch(run_case, 1, (case, steps, accelerator), timeout_s=600)[0]
    except Exception as err:  # noqa: BLE001 — one failing case must not hide the others' results
        return {"measured": None, "failure": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}


def row(case: Case, predicted: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    measured = result.get("measured")
    err = predicted["allocated"] / measured - 1 if measured else None
    return {
        "model": case.model,
        "strategy": case.strategy,
        "precision": case.precision,
        "batch": case.batch,
        "params": model_stats(case.model).params,
        "predicted_bytes": predicted["allocated"],
        "predicted_phase": predicted["phase"],
        "predicted_breakdown": predicted["breakdown"],
        "measured_bytes": measured,
        "error": err,
        "within_target": err is not None and abs(err) <= TARGET,
        **{k: v for k, v in result.items() if k != "measured"},
    }


def print_table(rows: list[dict[str, Any]], dry_run: bool) -> None:
    keys = ("parameters", "gradients", "optimizer_states", "activations", "transient", "buffers")
    head = f"{'case':<32} {'predicted GiB':>13} {'measured GiB':>12} {'error':>7}  {'peak':<5}" + "".join(
        f" {k[:6]:>7}" for k in keys
    )
    print(head + "\n" + "-" * len(head))
    for r in rows:
        label = f"{r['model']} {r['strategy']} {r['precision']} b{r['batch']}"
        if dry_run or r["measured_bytes"] is None:
            measured = "(dry run)" if dry_run else "OOM" if r.get("oom") else "FAILED" if r.get("failure") else "-"
        else:
            measured = f"{r['measured_bytes'] / GIB:.2f}"
        err = "" if r["error"] is None else f"{r['error']:+.1%}"
        print(
            f"{label:<32} {r['predicted_bytes'] / GIB:>13.2f} {measured:>12} {err:>7}  "
            f"{'bwd' if r['predicted_phase'] == 'backward' else 'opt':<5}"
            + "".join(f" {r['predicted_breakdown'][k] / GIB:>7.2f}" for k in keys)
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--models",
        help=f"comma-separated, from {', '.join(BATCHES)} (default: all but gpt-tiny, a "
        "0.17M model to check the script with)",
    )
    p.add_argument("--steps", type=int, default=3, help="training steps per case; the peak is taken after the first")
    p.add_argument("--quick", action="store_true", help="one batch size (and by default gpt-52m and mlp-100m only)")
    p.add_argument("--dry-run", action="store_true", help="print the predictions and the cases, run nothing")
    p.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "cpu"),
        help="cpu: run the cases here to check they work (no peak to compare)",
    )
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    default = "gpt-52m,mlp-100m" if a.quick else "gpt-52m,gpt2,gpt2-medium,mlp-100m"
    models = [m.strip() for m in (a.models or default).split(",")]
    unknown = [m for m in models if m not in BATCHES]
    if unknown:
        p.error(f"unknown model {unknown[0]!r}; choose from {', '.join(BATCHES)}")
    if not a.dry_run and a.device == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or with --dry-run (predictions only) or --device cpu")
    todo = cases(models, a.quick)
    where = "dry run: nothing is launched" if a.dry_run else f"{a.device}, {a.steps} steps per case"
    print(
        f"paratrain {paratrain.__version__}, torch {torch.__version__}; {len(todo)} cases ({where}); Adam; "
        f"target |error| <= {TARGET:.0%} of max_memory_allocated"
    )
    rows = []
    for i, case in enumerate(todo, 1):
        predicted = predict(case)
        result = {"measured": None} if a.dry_run else measure(case, a.steps, a.device)
        rows.append(row(case, predicted, result))
        if not a.dry_run:
            r = rows[-1]
            got = (
                "OOM"
                if r.get("oom")
                else r.get("failure")
                or ("ran" if r["measured_bytes"] is None else f"{r['measured_bytes'] / GIB:.2f} GiB, {r['error']:+.1%}")
            )
            print(
                f"[{i}/{len(todo)}] {case.label}: predicted {predicted['allocated'] / GIB:.2f} GiB, {got}", flush=True
            )
    print()
    print_table(rows, a.dry_run)
    compared = [r for r in rows if r["error"] is not None]
    if compared:
        print(f"within {TARGET:.0%}: {sum(r['within_target'] for r in compared)} of {len(compared)} cases")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"torch": torch.__version__, "device": a.device, "dry_run": a.dry_run, "steps": a.steps, "rows": rows},
                f,
                indent=2,
            )
    failed = [r for r in rows if r.get("failure")]
    for r in failed:
        print(f"FAILED {r['model']} {r['strategy']} {r['precision']} b{r['batch']}: {r['failure']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
