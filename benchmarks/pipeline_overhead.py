"""``Parallel("pipeline")`` and ``Parallel("hybrid")`` against hand-written ``torch.distributed.pipelining``
(CPU, gloo).

    .venv/bin/python benchmarks/pipeline_overhead.py                               # both jobs, 5 rounds x 6 steps
    .venv/bin/python benchmarks/pipeline_overhead.py --rounds 1 --steps 2          # a quick look (30 s)
    .venv/bin/python benchmarks/pipeline_overhead.py --which hybrid --hybrid-rounds 3 --hybrid-steps 4
    .venv/bin/python benchmarks/pipeline_overhead.py --rounds 9 --steps 10 --json out.json   # RESULTS.md §13, 3.5 min

Model: paratrain's own GPT (``paratrain.workloads.gpt``, GPT-2 shaped: learned positions, LayerNorm, biases, GELU
MLP) with 4 blocks, hidden 256, 8 heads, sequence 128, vocabulary 4096 and an *untied* head, so that no weight
lives on two stages (a tied embedding/head needs its two gradients summed across stages, which the hand-written
side would have to write out too). AdamW, fp32, one thread per process. The model is cut before ``blocks.2``:
stage 0 = embeddings + blocks 0-1, stage 1 = blocks 2-3 + final norm + head, on both sides.

Two jobs (``--which``):

* ``pipeline``: world 2, pp=2, a batch of 8 x 128 in 4 micro-batches of 2; subjects ``paratrain-1f1b`` /
  ``hand-1f1b`` and ``paratrain-gpipe`` / ``hand-gpipe``;
* ``hybrid``: world 4, dp=2 x pp=2 (the (dp, pp) mesh, pp innermost), DDP over dp, 1F1B; each replica reads its
  own 8 x 128 of a 16 x 128 batch, in 4 micro-batches; subjects ``paratrain`` / ``hand``. Four processes share
  two cores (a step takes about 1.6x as long): ``--hybrid-rounds`` / ``--hybrid-steps`` shorten it.

The subjects:

* ``paratrain``: ``Parallel("pipeline", schedule=..., microbatches=4, split_points=["blocks.2"])`` (or
  ``Parallel("hybrid", dp=2, ...)``), ``par.prepare(model, AdamW)``, then every step
  ``with par.step(model, opt): par.forward_backward(model, x, y, loss_fn)``;
* ``hand``: the stage built by hand as torchtitan builds one: a deep copy of the model keeping that stage's blocks,
  the embeddings only on the first stage and the final norm and head only on the last, and a forward that skips
  what the stage does not hold; ``PipelineStage(stage, index, 2, cpu, group=pp)`` (the stage wrapped in
  ``DistributedDataParallel`` over the dp group of an ``init_device_mesh("cpu", (2, 2), ("dp", "pp"))`` for
  hybrid), ``Schedule1F1B`` / ``ScheduleGPipe`` with 4 micro-batches, ``scale_grads=False`` and the loss
  ``cross_entropy(...) / 4`` (paratrain multiplies each micro-batch's loss by 1/4, bitwise the same, and leaves
  the gradients unscaled too), ``schedule.step(x)`` on the first stage and ``schedule.step(target=y,
  losses=losses)`` on the last (the calls as PyTorch documents them, outputs returned by default, as paratrain
  calls them), then ``opt.step(); opt.zero_grad(set_to_none=True)``; the last stage reads the loss as
  ``sum(losses)``, where paratrain also broadcasts it to every stage.

Same math: both sides start from the same weights and see the same batch, so the first step's loss (the last
stage's, per replica) must be the same; the parameters each rank holds are counted on both sides as well.

Step time: a barrier, then one whole step (schedule, optimizer, loss read) timed on every rank; the median of each
round's steps, the slower rank's per round, and the median over rounds. The subjects take turns in every round,
the order reversed every other round. ``x hand``: paratrain's step time over the hand-written one with the same
schedule; ``per-round``: the same ratio round by round.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.distributed.process_group import finish_group

LAYERS, HIDDEN, HEADS, SEQ, VOCAB = 4, 256, 8, 128, 4096
CUT = 2  # stage 1 starts at blocks.2
MICRO, PER_REPLICA = 4, 8  # micro-batches per step, samples per replica and step


def build() -> nn.Module:
    from paratrain.workloads.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(GPTConfig(layers=LAYERS, hidden=HIDDEN, heads=HEADS, seq_len=SEQ, vocab=VOCAB, tied=False))


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


class HandStage(nn.Module):
    """One stage of the GPT, cut by hand: a deep copy keeping this stage's blocks, the embeddings only on the first
    stage, the final norm and head only on the last."""

    def __init__(self, model: nn.Module, index: int, num_stages: int) -> None:
        super().__init__()
        whole = copy.deepcopy(model)
        first, last = index == 0, index == num_stages - 1
        start, end = (0, CUT) if first else (CUT, LAYERS)
        self.wte = whole.wte if first else None
        self.wpe = whole.wpe if first else None
        self.blocks = nn.ModuleList(whole.blocks[start:end])
        self.norm = whole.norm if last else None
        self.head = whole.head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.wte is not None:  # token ids in
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        if self.head is not None:  # logits out
            x = self.head(self.norm(x))
        return x


class Hand:
    """The hand-written pipeline: one stage per rank, its schedule and its optimizer."""

    def __init__(self, schedule: str, mesh: Any | None) -> None:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        pp_group = mesh["pp"].get_group() if mesh is not None else None  # None: the world is the pipeline
        pp_rank = mesh["pp"].get_local_rank() if mesh is not None else dist.get_rank()
        self.stage_module = HandStage(build(), pp_rank, 2)
        self.is_last = pp_rank == 1
        module: nn.Module = self.stage_module
        if mesh is not None:
            from torch.nn.parallel import DistributedDataParallel

            module = DistributedDataParallel(module, process_group=mesh["dp"].get_group())
        self.opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
        stage = PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=pp_group)
        cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
        self.schedule = cls(stage, MICRO, loss_fn=lambda out, y: loss_fn(out, y) / MICRO, scale_grads=False)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        if self.is_last:
            losses: list[torch.Tensor] = []
            self.schedule.step(target=y, losses=losses)
        else:
            self.schedule.step(x)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(torch.stack(losses).sum().detach()) if self.is_last else None

    def params(self) -> int:
        return sum(p.numel() for p in self.stage_module.parameters())

    def close(self) -> None:
        pass


class Paratrain:
    """``Parallel("pipeline")`` / ``Parallel("hybrid")`` with the same cut, schedule and micro-batches."""

    def __init__(self, strategy: str, schedule: str) -> None:
        options: dict[str, Any] = {"dp": 2} if strategy == "hybrid" else {}
        self.par = paratrain.Parallel(
            strategy, schedule=schedule, microbatches=MICRO, split_points=[f"blocks.{CUT}"], monitor=False, **options
        )
        plain = build()
        self.model, self.opt = self.par.prepare(plain, torch.optim.AdamW(plain.parameters(), lr=1e-4))
        self.is_last = self.model.is_last

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float | None:
        with self.par.step(self.model, self.opt):
            loss = self.par.forward_backward(self.model, x, y, loss_fn)
        return float(loss) if self.is_last else None  # every rank gets it; the last stage's is the one compared

    def params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def close(self) -> None:
        self.par.close()


def job(which: str, rounds: int, steps: int, warmup: int) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    if which == "hybrid":
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
        replica = mesh["dp"].get_local_rank()
        subjects: dict[str, Any] = {"paratrain": Paratrain("hybrid", "1f1b"), "hand": Hand("1f1b", mesh)}
        assert subjects["paratrain"].par.data_parallel_rank == replica
    else:
        replica = 0
        subjects = {
            "paratrain-1f1b": Paratrain("pipeline", "1f1b"),
            "hand-1f1b": Hand("1f1b", None),
            "paratrain-gpipe": Paratrain("pipeline", "gpipe"),
            "hand-gpipe": Hand("gpipe", None),
        }
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (2 * PER_REPLICA, SEQ + 1), generator=g)[replica * PER_REPLICA :][:PER_REPLICA]
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    out: dict = {
        s: {"rounds_ms": [], "params": subject.params(), "replica": replica, "is_last": subject.is_last}
        for s, subject in subjects.items()
    }
    for s, subject in subjects.items():
        out[s]["first_loss"] = subject.step(x, y)  # the same math: the same first loss
        for _ in range(warmup - 1):
            subject.step(x, y)
    order = list(subjects)
    for r in range(rounds):
        for s in order if r % 2 == 0 else order[::-1]:
            subject = subjects[s]
            times = []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                subject.step(x, y)
                times.append(time.perf_counter() - start)
            out[s]["rounds_ms"].append(1e3 * statistics.median(times))
    for subject in subjects.values():
        subject.close()
    finish_group()
    return out


def report(which: str, ranks: list[dict], rounds: int, steps: int) -> dict:
    rows: dict[str, dict] = {}
    for s in ranks[0]:
        per_round = [max(rank[s]["rounds_ms"][r] for rank in ranks) for r in range(rounds)]
        rows[s] = {
            "step_ms": statistics.median(per_round),
            "rounds_ms": [round(v, 1) for v in per_round],
            "params_per_rank": [rank[s]["params"] for rank in ranks],
            "first_loss": [rank[s]["first_loss"] for rank in ranks if rank[s]["is_last"]],
        }
    for s, row in rows.items():
        hand = rows[s.replace("paratrain", "hand")]
        row["x_hand"] = row["step_ms"] / hand["step_ms"]
        row["round_ratios"] = [round(a / b, 3) for a, b in zip(row["rounds_ms"], hand["rounds_ms"])]
    world = len(ranks)
    layout = "pp=2" if which == "pipeline" else "dp=2 x pp=2 (DDP over dp), 1f1b"
    print(
        f"\n{which}: GPT {LAYERS} blocks x {HIDDEN} (heads {HEADS}, vocab {VOCAB}, untied), {PER_REPLICA} x {SEQ} "
        f"per replica in {MICRO} micro-batches, fp32, AdamW, {layout} on {world} CPU processes (gloo); "
        f"{rounds} rounds x {steps} steps"
    )
    print(
        f"{'subject':<16} {'step ms':>8} {'x hand':>7} {'params/rank':>17}  {'first loss (last stage)':<24} "
        f"rounds (ms) | per-round x hand"
    )
    for s, row in rows.items():
        losses = ", ".join(f"{v:.6f}" for v in row["first_loss"])
        params = "/".join(str(p) for p in row["params_per_rank"][:2])
        ratios = f" | {row['round_ratios']}" if s.startswith("paratrain") else ""
        print(
            f"{s:<16} {row['step_ms']:>8.1f} {row['x_hand']:>7.3f} {params:>17}  {losses:<24} "
            f"{row['rounds_ms']}{ratios}"
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--which", default="pipeline,hybrid", help="jobs to run, comma-separated: pipeline, hybrid")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--hybrid-rounds", type=int, default=None, help="rounds of the hybrid job (default --rounds)")
    p.add_argument("--hybrid-steps", type=int, default=None, help="steps per round of the hybrid job (default --steps)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    p.add_argument("--json", help="write the figures here")
    a = p.parse_args()
    jobs = [w.strip() for w in a.which.split(",") if w.strip()]
    unknown = [w for w in jobs if w not in ("pipeline", "hybrid")]
    if unknown:
        p.error(f"unknown job(s) {unknown}; choose pipeline, hybrid")
    results = {}
    for which in jobs:
        rounds = a.rounds if which == "pipeline" or a.hybrid_rounds is None else a.hybrid_rounds
        steps = a.steps if which == "pipeline" or a.hybrid_steps is None else a.hybrid_steps
        world = 2 if which == "pipeline" else 4
        ranks = paratrain.launch(job, world, (which, rounds, steps, max(a.warmup, 1)), threads=1, timeout_s=1800)
        results[which] = {
            "rounds": rounds,
            "steps": steps,
            "world": world,
            "subjects": report(which, ranks, rounds, steps),
        }
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
