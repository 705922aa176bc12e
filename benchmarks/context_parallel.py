"""``Parallel("ddp", cp=C)`` on one long sequence: activation memory per rank, tokens/s, and paratrain's Ulysses
against one written by hand in plain torch (CPU, gloo, world 2 and 4).

    PYTHONPATH=src .venv/bin/python benchmarks/context_parallel.py --json context-parallel.json
    PYTHONPATH=src .venv/bin/python benchmarks/context_parallel.py --worlds 2 --rounds 1 --steps 1   # a quick look

Model: paratrain's GPT, Llama-shaped (RMSNorm, gated MLP, no biases, grouped-query attention, untied head), one
sequence of ``--seq`` tokens, fp32, SGD. In each launched job of ``C`` ranks (cp = C, one replica), subjects take
turns in every round (the order alternating):

* ``cp=1``: one plain process (rank 0; the others wait) on the whole sequence;
* ``paratrain``: ``Parallel("ddp", cp=C)``, ``par.forward_backward(model, x, y, loss_fn)`` on the whole sequence;
* ``hand``: the same exchange written out: each rank cuts its slice and positions, every block's attention kernel
  wrapped in two ``all_to_all_single_autograd`` (sequence -> heads -> sequence), the slice's mean loss weighted and
  summed over the ranks, DDP over every rank.

Step time: the median of each round's median, on the slowest rank; paratrain against hand also as the median of
each round's ratio. Activation memory: the bytes of the storages
autograd saves during one forward and loss (weights excluded), on rank 0, against cp=1's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import (
    all_reduce,
    all_to_all_single_autograd,
    wait_tensor,
)
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel

import paratrain
from paratrain.batch import ModelCall
from paratrain.distributed.process_group import finish_group
from paratrain.planner.layout import Layout
from paratrain.planner.memory import activation_figures
from paratrain.planner.training import Training
from paratrain.planner.transformer import GPTConfig, transformer_stats
from paratrain.workloads.gpt import GPT

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 1024, 128, 2, 8, 4


def shape(seq: int) -> GPTConfig:
    return GPTConfig(
        layers=LAYERS,
        hidden=HIDDEN,
        heads=HEADS,
        kv_heads=KV_HEADS,
        seq_len=seq,
        vocab=VOCAB,
        gated=True,
        bias=False,
        learned_positions=False,
        tied=False,
    )


def build(seq: int) -> nn.Module:
    torch.manual_seed(0)
    return GPT(shape(seq))


def planned(seq: int, cp: int) -> float:
    """The planner's activation bytes of one cp rank for this model and sequence (fp32, one sample)."""
    stats = transformer_stats(shape(seq), name="gpt")
    return activation_figures(stats, Training(precision="fp32", micro_batch=1), Layout.of(name="ddp", dp=1, cp=cp))[0]


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def saved(model: nn.Module, step) -> int:
    """Bytes of the storages autograd saves while ``step()`` builds its graph (``model``'s weights excluded)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    found: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in weights:
            found[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = step()
    loss.backward()
    return sum(found.values())


# --- the hand-written Ulysses -------------------------------------------------------------------------------------


def _exchange(x: torch.Tensor) -> torch.Tensor:
    return wait_tensor(all_to_all_single_autograd(x.contiguous(), None, None, dist.group.WORLD))


def _to_heads(x: torch.Tensor) -> torch.Tensor:  # [b, h, s/C, d] -> [b, h/C, s, d]
    c = dist.get_world_size()
    b, h, s, d = x.shape
    out = _exchange(x.reshape(b, c, h // c, s, d).transpose(0, 1))
    return out.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def _to_sequence(x: torch.Tensor) -> torch.Tensor:  # [b, h/C, s, d] -> [b, h, s/C, d]
    c = dist.get_world_size()
    b, h, s, d = x.shape
    out = _exchange(x.reshape(b, h, c, s // c, d).permute(2, 0, 1, 3, 4))
    return out.transpose(0, 1).reshape(b, c * h, s // c, d)


def hand_written(model: nn.Module) -> nn.Module:
    """Every block's attention kernel between the two exchanges, then DDP over every rank."""
    for block in model.blocks:
        kernel = block.attention.forward
        block.attention.forward = lambda q, k, v, kernel=kernel: _to_sequence(
            kernel(_to_heads(q), _to_heads(k), _to_heads(v))
        )
    return DistributedDataParallel(model)


def hand_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    c, r = dist.get_world_size(), dist.get_rank()
    s = x.shape[1] // c
    part = slice(r * s, (r + 1) * s)
    logits = model(x[:, part].contiguous(), positions=torch.arange(r * s, (r + 1) * s)[None])
    return wait_tensor(all_reduce(loss_fn(logits, y[:, part].contiguous()) / c, "sum", dist.group.WORLD))


# --- the job ------------------------------------------------------------------------------------------------------


def job(seq: int, rounds: int, steps: int) -> dict | None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]

    par = paratrain.Parallel("ddp", cp=world, monitor=False)
    ours = par.prepare(build(seq))
    ours_opt = torch.optim.SGD(ours.parameters(), lr=1e-3)
    hand = hand_written(build(seq))
    hand_opt = torch.optim.SGD(hand.parameters(), lr=1e-3)
    alone = build(seq)
    alone_opt = torch.optim.SGD(alone.parameters(), lr=1e-3)

    def step_ours() -> None:
        with par.step(ours, ours_opt):
            par.forward_backward(ours, x, y, loss_fn)

    def step_hand() -> None:
        hand_loss(hand, x, y).backward()
        hand_opt.step()
        hand_opt.zero_grad()

    def step_alone() -> None:
        if rank == 0:
            loss_fn(alone(x), y).backward()
            alone_opt.step()
            alone_opt.zero_grad()

    subjects = {"cp=1": step_alone, "paratrain": step_ours, "hand": step_hand}
    times: dict[str, list[float]] = {k: [] for k in subjects}
    for fn in subjects.values():
        fn()  # warm-up
    for r in range(rounds):
        order = list(subjects) if r % 2 == 0 else list(reversed(subjects))
        for name in order:
            per = []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                subjects[name]()
                per.append(time.perf_counter() - start)
            slowest = torch.tensor(statistics.median(per))
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[name].append(float(slowest))

    memory = {
        "cp=1": saved(alone, lambda: loss_fn(alone(x), y)) if rank == 0 else 0,
        "paratrain": saved(ours, lambda: par.strategy.batch(ModelCall.of(x, y, loss_fn, {})).loss(ours(x))),
        "hand": saved(hand, lambda: hand_loss(hand, x, y)),
    }
    ours_opt.zero_grad()
    hand_opt.zero_grad()
    alone_opt.zero_grad()
    par.close()
    finish_group()
    if rank:
        return None
    return {
        "world": world,
        "seq": seq,
        "step_s": {k: statistics.median(v) for k, v in times.items()},
        "rounds_s": times,
        "saved_bytes": memory,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worlds", default="2,4")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    results = []
    for world in (int(w) for w in args.worlds.split(",")):
        res = paratrain.launch(job, world, (args.seq, args.rounds, args.steps), timeout_s=1800)[0]
        step, mem = res["step_s"], res["saved_bytes"]
        res["tokens_per_s"] = {k: args.seq / v for k, v in step.items()}
        res["paratrain_over_hand"] = step["paratrain"] / step["hand"]
        rounds = res["rounds_s"]  # the same round's pair: steadier than the ratio of medians on a busy machine
        res["paratrain_over_hand_paired"] = statistics.median(
            p / h for p, h in zip(rounds["paratrain"], rounds["hand"])
        )
        res["memory_vs_cp1"] = {k: v / mem["cp=1"] for k, v in mem.items()}
        res["planner_bytes"] = {"cp=1": planned(args.seq, 1), "paratrain": planned(args.seq, world)}
        res["planner_over_measured"] = {k: v / mem[k] for k, v in res["planner_bytes"].items()}
        results.append(res)
        print(f"world {world} (cp={world}), seq {args.seq}:")
        for k in step:
            print(
                f"  {k:10s} step {step[k]:.3f} s  {res['tokens_per_s'][k]:8.0f} tok/s  saved "
                f"{mem[k] / 2**20:7.1f} MiB ({res['memory_vs_cp1'][k]:.2f} x cp=1)"
            )
        print(
            "  planner / measured saved bytes: "
            + ", ".join(f"{k} {v:.3f}" for k, v in res["planner_over_measured"].items())
        )
        print(
            f"  paratrain / hand: {res['paratrain_over_hand']:.3f} (median of rounds' ratios "
            f"{res['paratrain_over_hand_paired']:.3f})"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
