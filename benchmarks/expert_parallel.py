"""Expert parallelism on CPU (gloo): ``Parallel("zero3", ep=E)`` against ``zero3`` without it and against a
hand-written all-to-all dispatch in plain torch, at world 2 and 4.

    .venv/bin/python benchmarks/expert_parallel.py --json expert-parallel.json    # 5 interleaved rounds
    .venv/bin/python benchmarks/expert_parallel.py --rounds 1 --steps 2            # a quick look
    .venv/bin/python benchmarks/expert_parallel.py --hybrid --worlds 4 --rounds 1   # hybrid, pp=2, with and without ep
    .venv/bin/python benchmarks/expert_parallel.py --tp --worlds 4 --rounds 1       # zero3 x tp=2, with and without ep

Model: our GPT with experts (:mod:`paratrain.workloads.gpt`): 2 blocks x 128, 8 routed experts of top 2 (SwiGLU,
width 256) per block, vocab 512; each rank a batch of 8 x 128 tokens; fp32, AdamW. Subjects, one after the other in
every round (their order rotating), a few steps each, the same batch:

* ``zero3``: ``Parallel("zero3")``: every expert sharded over all ranks, gathered per block;
* ``zero3 ep=E``: ``Parallel("zero3", ep=E)``: each rank holds 1/E of the experts, tokens sent to them (all-to-all);
* ``hand ep=W``: the same layout as ``zero3 ep=W`` written in plain torch (:class:`HandExperts`): each rank's slice of
  the experts as plain parameters, the counts and rows exchanged with torch's all-to-all, FSDP2's ``fully_shard``
  on the blocks and the root with the experts left out (``ignored_params``), their gradients divided by the ranks.

With ``--hybrid`` the subjects are instead ``Parallel("hybrid", dp=W/2)`` (2 pipeline stages of one block each,
replicated by DDP) and ``Parallel("hybrid", dp=W/2, ep=2)`` (each stage's experts split over 2 of its replicas),
without a hand-written row: what they check is the planner's per-rank expert bytes under a pipeline. With ``--tp``
they are ``Parallel("zero3", tp=2)`` and ``Parallel("zero3", tp=2, ep=2)`` (the experts whole to tp, split over each
tp rank's replicas), for the same check beside tensor parallelism.

Figures: the step time (median of each round's median, on the slowest rank; and the fastest round) and tokens/s
over all ranks; ``x hand``: the median over rounds of the step time over the hand-written one's in the same round
(with ``--hybrid`` or ``--tp``, over the ep row's);
what a rank holds of the experts (parameters plus AdamW's state, bytes of the local tensors after a step) against the
planner's figure for the layout (:mod:`paratrain.planner.expert_parallel`); the resident high-water mark of a step above
the resident memory before it (``/proc/self/clear_refs``; glibc set to return every block over 64 KiB when freed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.nn import functional as F

import paratrain
from paratrain.distributed.process_group import finish_group
from paratrain.planner.moe import MoE
from paratrain.planner.transformer import GPTConfig
from paratrain.workloads.experts import activate

CFG = GPTConfig(
    layers=2,
    hidden=128,
    heads=4,
    seq_len=128,
    vocab=512,
    gated=True,
    bias=False,
    tied=False,
    learned_positions=False,
    moe=MoE(experts=8, top_k=2, ffn=256),
)
BATCH = 8  # samples of CFG.seq_len tokens per rank


def build() -> nn.Module:
    from paratrain.workloads.gpt import GPT

    torch.manual_seed(0)
    return GPT(CFG)


def _wait(t: torch.Tensor) -> torch.Tensor:
    return t.wait() if hasattr(t, "wait") else t


class HandExperts(nn.Module):
    """One block's routed experts, this rank's slice of them, with the dispatch written out: the same
    ``forward(rows sorted by expert, counts)`` as :class:`paratrain.workloads.experts.Experts`."""

    def __init__(self, full: nn.Module) -> None:
        super().__init__()
        self.ranks, rank = dist.get_world_size(), dist.get_rank()
        self.n = full.gate_up.shape[0] // self.ranks
        own = slice(rank * self.n, (rank + 1) * self.n)
        self.gate_up = nn.Parameter(full.gate_up.detach()[own].clone())
        self.down = nn.Parameter(full.down.detach()[own].clone())
        self.gated = full.gated

    def forward(self, rows: torch.Tensor, counts: torch.Tensor | list[int]) -> torch.Tensor:
        sent = torch.as_tensor(counts).view(self.ranks, self.n)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent)
        out_splits, in_splits = sent.sum(1).tolist(), received.sum(1).tolist()
        arrived = _wait(all_to_all_single_autograd(rows, in_splits, out_splits, dist.group.WORLD))
        order = torch.arange(self.n).repeat(self.ranks).repeat_interleave(received.flatten()).argsort(stable=True)
        parts = arrived[order].split(received.sum(0).tolist())
        computed = torch.cat(
            [
                F.linear(activate(F.linear(part, self.gate_up[e]), self.gated), self.down[e])
                for e, part in enumerate(parts)
            ]
        )
        return _wait(all_to_all_single_autograd(computed[order.argsort()], out_splits, in_splits, dist.group.WORLD))


def hand_written(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        block.moe.experts = HandExperts(block.moe.experts)
    experts = {p for block in model.blocks for p in block.moe.experts.parameters()}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh, ignored_params=experts)
    fully_shard(model, mesh=mesh, ignored_params=experts)
    for p in experts:  # their gradient sums every rank's tokens: the mean over ranks is a division
        p.register_hook(lambda g: g / dist.get_world_size())
    return model


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _options(subject: str, world: int) -> dict[str, int]:
    """The strategy options of ``subject`` (``zero3 ep=2``, ``hybrid ep=2``, ``zero3 tp=2 ep=2``) at ``world``
    ranks: hybrid's 2 stages."""
    degrees = {k: int(v) for k, v in (word.split("=") for word in subject.split()[1:])}
    return {**({"dp": world // 2} if subject.startswith("hybrid") else {}), **degrees}


def prepared(subject: str) -> tuple[object, nn.Module, torch.optim.Optimizer]:
    model = build()
    if subject.startswith("hand"):
        model = hand_written(model)
        return None, model, torch.optim.AdamW(model.parameters(), lr=1e-3)
    par = paratrain.Parallel(subject.split()[0], monitor=False, **_options(subject, dist.get_world_size()))
    model, opt = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return par, model, opt


def one_step(par: object, model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    if par is None:
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())
    with par.step(model, opt):
        loss = par.forward_backward(model, x, y, _loss)
    return float(loss)


def expert_bytes(model: nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the routed experts' parameters and their optimizer state this rank holds (local tensors)."""

    def local(t: torch.Tensor) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    params = [p for n, p in model.named_parameters() if ".experts." in n]
    return sum(local(p) + sum(local(v) for v in opt.state[p].values() if torch.is_tensor(v)) for p in params)


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _sharing(mode: str) -> int:
    """Consecutive ranks that read one batch: a tp group's 2, a 2-stage pipeline's 2, else 1."""
    return 1 if mode == "zero3" else 2


def subjects_at(world: int, mode: str) -> list[str]:
    if mode == "hybrid":
        return ["hybrid", "hybrid ep=2"]
    if mode == "tp":
        return ["zero3 tp=2", "zero3 tp=2 ep=2"]
    return ["zero3", *(f"zero3 ep={e}" for e in (2, 4) if e <= world), f"hand ep={world}"]


def job(rounds: int, steps: int, warmup: int, mode: str = "zero3") -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    names = subjects_at(world, mode)
    g = torch.Generator().manual_seed(dist.get_rank() // _sharing(mode))  # a tp group or a pipeline: one batch
    ids = torch.randint(0, CFG.vocab, (BATCH, CFG.seq_len + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    subjects = {s: prepared(s) for s in names}
    out: dict = {s: {"rounds_ms": [], "peaks": []} for s in subjects}
    for s, (par, model, opt) in subjects.items():
        out[s]["first_loss"] = one_step(par, model, opt, x, y)
        for _ in range(warmup - 1):
            one_step(par, model, opt, x, y)
        out[s]["expert_bytes"] = expert_bytes(par.unwrap(model) if par else model, opt)
    for r in range(rounds):
        for s in names[r % len(names) :] + names[: r % len(names)]:
            par, model, opt = subjects[s]
            times = []
            for _ in range(steps):
                dist.barrier()
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
                before, start = _status("VmRSS"), time.perf_counter()
                one_step(par, model, opt, x, y)
                times.append(time.perf_counter() - start)
                out[s]["peaks"].append(_status("VmHWM") - before)
            out[s]["rounds_ms"].append(1e3 * statistics.median(times))
    for par, _, _ in subjects.values():
        if par is not None:
            par.close()
    finish_group()
    return out


def planned_bytes(subject: str, world: int) -> int:
    """The planner's bytes of routed experts one rank holds (parameters and AdamW's two moments, fp32) under
    ``subject``'s layout: its fullest stage's experts (``memory.ranked_split``), sharded as ZeRO shards them."""
    from paratrain.planner.expert_parallel import expert_fraction
    from paratrain.planner.layout import Layout
    from paratrain.planner.memory import ranked_split
    from paratrain.planner.transformer import transformer_stats

    options = _options(subject, world)
    stats = transformer_stats(CFG, name="gpt-moe")
    ep, tp = options.get("ep", 1), options.get("tp", 1)
    if subject.startswith("hybrid"):
        layout = Layout.of("hybrid", dp=options["dp"], pp=world // options["dp"], ep=ep)
    else:
        layout = Layout.of("zero3", dp=world // tp, zero=3, shard=world // tp, tp=tp, ep=ep)
    experts = ranked_split(stats, layout)[1]
    return round(experts * (expert_fraction(stats, layout) if layout.zero else 1) * 4 * 3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--json", help="write the figures here")
    modes = p.add_mutually_exclusive_group()
    modes.add_argument(
        "--hybrid",
        action="store_const",
        dest="mode",
        const="hybrid",
        default="zero3",
        help="hybrid (2 stages) with and without ep=2, not zero3",
    )
    modes.add_argument("--tp", action="store_const", dest="mode", const="tp", help="zero3 x tp=2 with and without ep=2")
    a = p.parse_args()
    if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "65536":  # glibc reads it at start: run again with it set
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
        sys.exit(subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode)
    results = {}
    for world in map(int, a.worlds.split(",")):
        ranks = paratrain.launch(job, world, (a.rounds, a.steps, a.warmup, a.mode), timeout_s=1800)
        hand = subjects_at(world, a.mode)[-1]  # the row the others are paired with (hand-written, or hybrid ep)
        rows = {}
        for s in ranks[0]:
            per_round = [max(rank[s]["rounds_ms"][r] for rank in ranks) for r in range(a.rounds)]
            step_ms = statistics.median(per_round)
            rows[s] = {
                "step_ms": round(step_ms, 1),
                "rounds_ms": [round(v, 1) for v in per_round],
                "tokens_per_s": round(world // _sharing(a.mode) * BATCH * CFG.seq_len / step_ms * 1e3),
                "expert_bytes": [rank[s]["expert_bytes"] for rank in ranks],
                "planned_expert_bytes": planned_bytes(s, world) if not s.startswith("hand") else None,
                "peak_mib": round(
                    statistics.median(
                        max(rank[s]["peaks"][i] for rank in ranks) for i in range(len(ranks[0][s]["peaks"]))
                    )
                    / 2**20,
                    1,
                ),
                "first_loss": ranks[0][s]["first_loss"],
            }
        for row in rows.values():  # paired with the hand-written step of the same round: the load is shared
            row["x_hand"] = round(
                statistics.median(r / h for r, h in zip(row["rounds_ms"], rows[hand]["rounds_ms"], strict=True)), 3
            )
        results[world] = rows
        print(
            f"\nworld {world}: GPT {CFG.layers} x {CFG.hidden}, {CFG.moe.experts} experts top {CFG.moe.top_k} "
            f"(width {CFG.moe.ffn}), {BATCH} x {CFG.seq_len} tokens a rank, fp32, AdamW; "
            f"{a.rounds} rounds x {a.steps} steps"
        )
        print(
            f"{'subject':<16} {'step ms':>8} {'min ms':>7} {'x hand':>7} {'tokens/s':>9} {'experts+opt/rank':>17} "
            f"{'planner':>9} {'peak MiB':>9} {'first loss':>11}  rounds (ms)"
        )
        for s, row in rows.items():
            held, planned = max(row["expert_bytes"]), row["planned_expert_bytes"]
            ratio = "" if planned is None else f"{planned / held:.3f}x"
            print(
                f"{s:<16} {row['step_ms']:>8.1f} {min(row['rounds_ms']):>7.1f} {row['x_hand']:>7.3f} "
                f"{row['tokens_per_s']:>9} {held / 2**20:>13.2f} MiB {ratio:>9} "
                f"{row['peak_mib']:>9.1f} {row['first_loss']:>11.6f}  {row['rounds_ms']}"
            )
        time.sleep(1)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
