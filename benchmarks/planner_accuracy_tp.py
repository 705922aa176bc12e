"""The planner's tensor-parallel step time against measured ones (CPU, gloo, world 2), and its collective count
against the one torch issues.

    .venv/bin/python benchmarks/planner_accuracy_tp.py            # 2 rounds x 8 steps, about a minute on 2 cores
    .venv/bin/python benchmarks/planner_accuracy_tp.py --json out.json

Measured: paratrain's ``Parallel("tp")`` on ``workloads.gpt.GPT`` (its built-in plan), and the same plan applied by
hand with ``parallelize_module`` (torchtitan's way, the planner's arithmetic): the QKV projection and the MLP's first
linear column-parallel, the attention output and the MLP's second linear row-parallel, the norms
sequence-parallel, a vocab-parallel embedding and head, and the loss under ``loss_parallel``. The GPT stores
``qkv`` per head, so a plain column split gives each rank whole heads; the first loss is checked against one
process's. The hand-written step lets Adam step the norms' ``Partial`` gradients (3 all-reduces each, a step);
paratrain sums them once (``tensor_parallel.compose``).

Model: GPT 2 layers, hidden 256, 4 heads, seq 128, vocab 2048, biases, no position table, untied head (TP splits
an untied head without a tie to keep); fp32, Adam, global batch 8. The planner plans it from its closed forms,
calibrated as ``planner_accuracy.py`` calibrates: world 1 on one thread (forward+backward of the batch and of a
quarter of it, the Adam step) and on all cores; its link from the collectives timed in the job at the size TP
sends; and DTensor's machinery (``Device.tp_call_s``) from a TP step on a fake group, predicted with and without
it. ddp at world 2 is measured alongside as a control: its error is the calibration's, not tensor parallelism's.
Measured: median of round medians, slowest rank.

Collective count and machinery: the same TP model in this process on a fake two-rank group (collectives return
at once): the collectives of a forward+backward and of the Adam step under ``CommDebugMode``, against
``tensor_parallel.collectives_per_micro_batch``, and the time of a whole step without communication: one rank's
compute plus DTensor's own machinery.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from planner_accuracy import median_s, round_robin_s  # the same timing as the other strategies'
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.distributed.process_group import finish_group
from paratrain.planner import Measured, PlanConfig, Training, make_plan, transformer_stats
from paratrain.planner.tensor_parallel import collectives_per_micro_batch
from paratrain.workloads.gpt import GPT, GPTConfig

CFG = GPTConfig(layers=2, hidden=256, heads=4, seq_len=128, vocab=2048, learned_positions=False, tied=False)
BATCH = 8
WORLD = 2


def data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, CFG.vocab, (BATCH, CFG.seq_len), generator=g),
        torch.randint(0, CFG.vocab, (BATCH, CFG.seq_len), generator=g),
    )


def build() -> GPT:
    torch.manual_seed(0)
    return GPT(CFG)


def world1(steps: int, warmup: int, threads: int) -> dict[str, float]:
    """Median seconds of the plain model's forward+backward (whole batch and a quarter) and Adam step."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = build()
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        x, y = data()

        def forward_backward(n: int) -> Callable[[], None]:
            def run() -> None:
                opt.zero_grad(set_to_none=True)
                F.cross_entropy(model(x[:n]).flatten(0, 1), y[:n].flatten()).backward()

            return run

        forward_backward(BATCH)()
        return {
            "forward_backward": median_s(forward_backward(BATCH), steps, warmup),
            "quarter": median_s(forward_backward(BATCH // 4), steps, warmup),
            "adam": median_s(opt.step, steps, warmup),
        }
    finally:
        torch.set_num_threads(before)


def parallelize(model: GPT, mesh: object) -> GPT:
    """Megatron-style TP with sequence parallelism on ``model`` over a 1-D ``mesh`` (torchtitan's plan)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module

    for block in model.blocks:  # the GPT lays qkv out per head: a plain column split gives each rank whole heads
        parallelize_module(
            block,
            mesh,
            {  # type: ignore[arg-type]
                "norm1": SequenceParallel(),
                "qkv": ColwiseParallel(input_layouts=Shard(1)),
                "proj": RowwiseParallel(output_layouts=Shard(1)),
                "norm2": SequenceParallel(),
                "fc": ColwiseParallel(input_layouts=Shard(1)),
                "out": RowwiseParallel(output_layouts=Shard(1)),
            },
        )
    parallelize_module(
        model,
        mesh,
        {  # type: ignore[arg-type]
            "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), use_local_output=False),
        },
    )
    return model


def tp_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
    return loss


def link_timings(repeats: int) -> dict[str, tuple[float, ...]]:
    """Median seconds of the collectives TP issues, at its size (a micro-batch's activations, fp32)."""
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    full = torch.randn(BATCH * CFG.seq_len * CFG.hidden)
    shard, tiny = torch.empty(full.numel() // WORLD), torch.zeros(2)
    ops = {
        "all_reduce": (full.numel() * 4, lambda: dist.all_reduce(full)),
        "all_reduce_small": (8, lambda: dist.all_reduce(tiny)),
        "all_gather": (full.numel() * 4, lambda: all_gather(full, shard)),
        "reduce_scatter": (full.numel() * 4, lambda: reduce_scatter(shard, full)),
    }
    medians = round_robin_s(ops, repeats)
    return {name: (size, medians[name]) for name, (size, _) in ops.items()}


def job(rounds: int, steps: int, warmup: int) -> dict[str, object]:
    """One rank: link figures, then tp and ddp steps in interleaved rounds."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    link = link_timings(repeats=10)
    x, y = data()
    tp_model = parallelize(build(), init_device_mesh("cpu", (WORLD,)))
    tp_opt = torch.optim.Adam(tp_model.parameters(), lr=1e-4)
    par = paratrain.Parallel("tp", monitor=False)
    model = build()
    par_model, par_opt = par.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-4))
    ddp_model = DistributedDataParallel(build())
    ddp_opt = torch.optim.Adam(ddp_model.parameters(), lr=1e-4)
    rank = dist.get_rank()
    xs, ys = x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]

    def tp_step() -> float:
        tp_opt.zero_grad(set_to_none=True)
        loss = tp_loss(tp_model, x, y)
        tp_opt.step()
        return loss.full_tensor().item() if hasattr(loss, "full_tensor") else loss.item()

    def paratrain_step() -> None:
        with par.step(par_model, par_opt):
            par.forward_backward(par_model, x, y, lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))

    def ddp_step() -> None:
        ddp_opt.zero_grad(set_to_none=True)
        F.cross_entropy(ddp_model(xs).flatten(0, 1), ys.flatten()).backward()
        ddp_opt.step()

    first_loss = tp_step()
    steps_by_name = (("paratrain tp", paratrain_step), ("hand tp", tp_step), ("ddp", ddp_step))
    per_round: dict[str, list[float]] = {name: [] for name, _ in steps_by_name}
    for r in range(rounds):
        for name, step in steps_by_name[:: 1 if r % 2 == 0 else -1]:
            dist.barrier()
            per_round[name].append(median_s(step, steps, warmup))
    finish_group()
    return {"link": link, "first_loss": first_loss, "step_s": {k: statistics.median(v) for k, v in per_round.items()}}


def fake_group(steps: int, warmup: int) -> dict[str, object]:
    """On a fake two-rank group in this process (one thread; its collectives return at once): the collectives of
    one TP forward+backward and of the Adam step, by type (``CommDebugMode``), and the median seconds of a whole TP
    step: one rank's compute and DTensor's machinery, without communication."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    try:
        model = parallelize(build(), init_device_mesh("cpu", (WORLD,)))
        opt = torch.optim.Adam(model.parameters(), lr=1e-4)
        x, y = data()
        with CommDebugMode() as comm:
            tp_loss(model, x, y)
        with CommDebugMode() as opt_comm:
            opt.step()

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            tp_loss(model, x, y)
            opt.step()

        def counts(mode: CommDebugMode) -> dict[str, int]:
            return {str(k).rsplit(".", 1)[-1]: v for k, v in mode.get_comm_counts().items()}

        return {"forward_backward": counts(comm), "adam": counts(opt_comm), "step_s": median_s(step, steps, warmup)}
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(before)


def micro_step_time(w1: dict[str, float]) -> tuple[int, float] | None:
    """The quarter batch's forward+backward, for the planner's batch-independent part (what it took beyond a quarter
    of the whole batch's time); None when it took no more than that: there is none to fit (``calibrated`` refuses
    it), and the weights stream at the optimizer's bandwidth."""
    return (BATCH // 4, w1["quarter"]) if 4 * w1["quarter"] > w1["forward_backward"] else None


def predict(w1: dict[str, float], link: dict[str, tuple[float, ...]], tp_step_time: float | None) -> dict[str, float]:
    measured = Measured(
        micro_step_time=micro_step_time(w1),
        link_timings=link,
        tp_step_time=tp_step_time,
        host_step_time=(w1["host_forward_backward"], w1["host_adam"]),
    )
    training = Training(precision="fp32", optimizer="adam", micro_batch=BATCH, global_batch=BATCH)
    plan = make_plan(
        transformer_stats(CFG, name="gpt-tp-bench"),
        PlanConfig(
            gpu="cpu",
            gpus=WORLD,
            training=training,
            step_time=w1["forward_backward"],
            optimizer_time=w1["adam"],
            threads=1,
            measured=measured,
        ),
    )
    by_name = {e.name: e for e in plan.estimates}
    tp = by_name["tp"].time
    return {
        "tp": tp.step_s,
        "ddp": by_name["ddp"].time.step_s,
        "tp_comm": tp.tp_comm_s,
        "tp_compute": tp.step_s - tp.exposed_comm_s,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--json", help="write the results here")
    a = p.parse_args()
    cores = torch.get_num_threads()
    fake = fake_group(a.steps, a.warmup)
    expected = collectives_per_micro_batch(transformer_stats(CFG, name="gpt-tp-bench"), False)
    print(
        f"torch {torch.__version__}; fake 2-rank group: collectives of one TP forward+backward "
        f"{fake['forward_backward']} (planner: {expected}), of the Adam step {fake['adam']}; a TP step without "
        f"communication {1e3 * fake['step_s']:.1f} ms (one thread)"
    )
    w1 = world1(a.steps, a.warmup, threads=1)
    w1.update({f"host_{k}": v for k, v in world1(a.steps, a.warmup, threads=cores).items() if k != "quarter"})
    print("world 1: " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in w1.items()))
    model = build()
    x, y = data()
    single_loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten()).item()
    ranks = paratrain.launch(job, WORLD, (a.rounds, a.steps, a.warmup), timeout_s=600)
    link = {name: (ranks[0]["link"][name][0], max(r["link"][name][1] for r in ranks)) for name in ranks[0]["link"]}
    measured = {name: max(r["step_s"][name] for r in ranks) for name in ranks[0]["step_s"]}
    plain, calibrated = predict(w1, link, None), predict(w1, link, fake["step_s"])
    print(f"first loss: hand tp {ranks[0]['first_loss']:.6f}, one process {single_loss:.6f}")
    print("link: " + ", ".join(f"{k} {1e3 * v[1]:.2f} ms" for k, v in link.items()))
    print(f"{'strategy':<13} {'measured ms':>11} {'predicted ms':>12} {'error':>7} {'with tp_call_s':>14} {'error':>7}")
    rows = []
    for name, kind in (("paratrain tp", "tp"), ("hand tp", "tp"), ("ddp", "ddp")):
        err, err_cal = plain[kind] / measured[name] - 1, calibrated[kind] / measured[name] - 1
        rows.append(
            {
                "strategy": name,
                "measured_ms": 1e3 * measured[name],
                "predicted_ms": 1e3 * plain[kind],
                "error": err,
                "calibrated_ms": 1e3 * calibrated[kind],
                "calibrated_error": err_cal,
            }
        )
        print(
            f"{name:<13} {1e3 * measured[name]:>11.1f} {1e3 * plain[kind]:>12.1f} {err:>+7.1%} "
            f"{1e3 * calibrated[kind]:>14.1f} {err_cal:>+7.1%}"
        )
    print(
        f"tp predicted with tp_call_s: {1e3 * calibrated['tp_compute']:.1f} ms compute, optimizer and DTensor "
        f"machinery (the fake group's step without communication: {1e3 * fake['step_s']:.1f} ms), "
        f"{1e3 * calibrated['tp_comm']:.1f} ms activation collectives (paratrain's measured step minus the fake "
        f"group's: {1e3 * (measured['paratrain tp'] - fake['step_s']):.1f} ms)"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {
                    "fake_group": fake,
                    "planner_collectives": expected,
                    "world1_ms": {k: 1e3 * v for k, v in w1.items()},
                    "link": link,
                    "rows": rows,
                    "first_loss": {"tp": ranks[0]["first_loss"], "single": single_loss},
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
