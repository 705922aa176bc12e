"""``cp_method="allgather"`` against ``"ulysses"`` at the same cp: step time per method on one long sequence (CPU,
gloo, world 2 and 4), and the planner's exchange bytes per layer for each.

    PYTHONPATH=src .venv/bin/python benchmarks/cp_methods.py --json cp-methods.json
    PYTHONPATH=src .venv/bin/python benchmarks/cp_methods.py --worlds 2 --rounds 1 --steps 1   # a quick look

Model: paratrain's GPT, Llama-shaped (RMSNorm, gated MLP, grouped-query attention with 8 heads and 4 key/value heads,
so that Ulysses runs at cp 2 and 4 too), one sequence of ``--seq`` tokens, fp32, SGD. In each launched job of ``C``
ranks (cp = C, one replica), ``Parallel("ddp", cp=C, cp_method=m)`` for each method takes turns in every round (the
order alternating), ``par.forward_backward(model, x, y, loss_fn)`` on the whole sequence. Step time: the median of
each round's median, on the slowest rank. Bytes: :mod:`paratrain.planner.context_parallel`'s per layer and forward,
sent by one rank, for this model and sequence and for Llama-3-70B (64 heads, 8 key/value heads) at 128k tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.distributed.process_group import finish_group
from paratrain.planner.context_parallel import all_gather_bytes, all_to_all_bytes
from paratrain.planner.transformer import TRANSFORMERS, GPTConfig, transformer_stats
from paratrain.workloads.gpt import GPT

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 1024, 128, 2, 8, 4
METHODS = ("ulysses", "allgather")


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


def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), y.flatten())


def layer_bytes(config: GPTConfig, cp: int) -> dict[str, float]:
    """Bytes one rank sends per layer and forward under each method (fp32 here: the compute dtype of this run)."""
    stats = transformer_stats(config, name="gpt")
    q, kv = all_to_all_bytes(stats, "fp32", 1, 1, cp)
    off = (cp - 1) / cp
    return {"ulysses": off * 2 * (q + kv), "allgather": off * 2 * all_gather_bytes(stats, "fp32", 1, 1)}


def job(seq: int, rounds: int, steps: int) -> dict | None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (1, seq + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    runs = {}
    for method in METHODS:
        par = paratrain.Parallel("ddp", cp=world, cp_method=method, monitor=False)
        model = par.prepare(build(seq))
        runs[method] = (par, model, torch.optim.SGD(model.parameters(), lr=1e-3))

    def step(method: str) -> float:
        par, model, opt = runs[method]
        with par.step(model, opt):
            loss = par.forward_backward(model, x, y, loss_fn)
        return float(loss)

    losses = {m: step(m) for m in METHODS}  # warm-up; the same first loss under both
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    for r in range(rounds):
        for method in METHODS if r % 2 == 0 else tuple(reversed(METHODS)):
            per = []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                step(method)
                per.append(time.perf_counter() - start)
            slowest = torch.tensor(statistics.median(per))
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[method].append(float(slowest))
    for par, _, _ in runs.values():
        par.close()
    finish_group()
    if rank:
        return None
    return {
        "world": world,
        "seq": seq,
        "first_loss": losses,
        "step_s": {m: statistics.median(v) for m, v in times.items()},
        "rounds_s": times,
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
        res["bytes_per_layer"] = layer_bytes(shape(args.seq), world)
        res["bytes_per_layer_llama70b_128k"] = layer_bytes(
            GPTConfig(**{**vars(TRANSFORMERS["llama3-70b"]), "seq_len": 131072}), world
        )
        step = res["step_s"]
        res["allgather_over_ulysses"] = step["allgather"] / step["ulysses"]
        results.append(res)
        print(f"cp={world}, seq {args.seq} (first loss {res['first_loss']}):")
        for m in METHODS:
            print(
                f"  {m:10s} step {step[m]:.3f} s  {args.seq / step[m]:8.0f} tok/s  "
                f"sent per layer {res['bytes_per_layer'][m] / 2**20:.2f} MiB "
                f"(Llama-3-70B at 128k: {res['bytes_per_layer_llama70b_128k'][m] / 2**20:.0f} MiB)"
            )
        print(f"  allgather / ulysses step time: {res['allgather_over_ulysses']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args), "results": results},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
