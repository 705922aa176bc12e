"""What the monitor's tokens-per-expert tests run: tiny mixtures of experts trained on a global batch, on 2 gloo
ranks (each its half) or in one process (all of it), returning the routing the monitor reported per window.

One spawn runs every case on one process group (:func:`helpers.cases.each_case`).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

import paratrain
from paratrain.monitor import MonitorConfig

STEPS, BATCH, SEQ, VOCAB = 4, 4, 8, 64
"""Optimizer steps, samples per rank and step at world 2, tokens per sample, vocabulary."""


def gpt_experts(bias: bool = False) -> nn.Module:
    """paratrain's GPT with 4 experts of top 2 per block (its experts module is given counts, not indices)."""
    from paratrain.planner.moe import MoE
    from paratrain.workloads.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    return GPT(
        GPTConfig(
            layers=2, hidden=32, heads=2, seq_len=SEQ, vocab=VOCAB, moe=MoE(experts=4, top_k=2, ffn=16, bias=bias)
        )
    )


def collapsed_gpt() -> nn.Module:
    """Routers that send every token to experts 0 and 1: a zero weight and a bias far apart from the others."""
    model = gpt_experts(bias=True)
    with torch.no_grad():
        for block in model.blocks:
            block.moe.router.weight.zero_()
            block.moe.router.bias.copy_(torch.tensor([8.0, 6.0, 0.0, 0.0]))
    return model


def _model(name: str) -> nn.Module:
    from helpers.moe_models import routed_mixtral

    return {"mixtral": routed_mixtral, "gpt": gpt_experts, "collapsed": collapsed_gpt}[name]()


def _loss(name: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if name == "mixtral":
        return model(x, labels=x).loss
    logits = model(x[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())


def global_batches(world: int = 2) -> torch.Tensor:
    """Every step's global batch of token ids: (steps, world x BATCH, SEQ)."""
    return torch.randint(0, VOCAB, (STEPS, world * BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def train(name: str, strategy: str, *, every: int = 2, persist: int = 3, samples: int | None = None) -> dict:
    """STEPS steps of model ``name`` under ``strategy`` (a name, then degrees: ``"zero3 ep=2"``); each replica reads
    its slice of the global batch (one process: its first ``samples``, all of it when None). Returns every window's
    tokens per expert (layer name -> counts), the warnings raised and the lines rank 0 emitted."""
    strategy, *degrees = strategy.split()
    options = {k: int(v) for k, v in (d.split("=") for d in degrees)}
    # windows of one or two steps of a few ms on 2 shared cores: a rank can reach the sync point 20% late by chance,
    # and these tests watch the routing, not stragglers (a rank would have to be late by a whole step)
    config = MonitorConfig(every=every, persist=persist, summary=False, straggler_min_cost=1.0)
    par = paratrain.Parallel(strategy, monitor=config, **options)
    emitted: list[str] = []
    par.monitor.emit = emitted.append
    model = _model(name)
    model, optimizer = par.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01))
    replica = par.data_parallel_rank
    mine = slice(replica * BATCH, (replica + 1) * BATCH) if par.world_size > 1 else slice(samples)
    windows = []
    for step, batch in enumerate(global_batches(max(par.world_size, 2)), 1):
        with par.step(model, optimizer):
            par.backward(_loss(name, model, batch[mine].to(par.device)))
        if step % every == 0:
            windows.append({x.layer: x.counts for x in par.monitor.expert_loads})
    warnings = [(w.kind, w.message) for w in par.monitor.warnings]
    par.close()
    return {"windows": windows, "warnings": warnings, "emitted": emitted}


def all_to_all_case() -> dict:
    """The bench's all-to-all of one step of gpt-moe-tiny, timed on this group."""
    from paratrain.bench.all_to_all import step_all_to_all
    from paratrain.workloads import get_workload

    workload = get_workload("gpt-moe-tiny")
    model = workload.model()
    x, _ = workload.make_batch(2, torch.Generator().manual_seed(0))
    seconds, sent = step_all_to_all(model, lambda: model(x), torch.device("cpu"))
    return {"seconds": seconds, "bytes": sent}


CASES = (
    ("mixtral", "ddp"),
    ("mixtral", "zero3"),
    ("gpt", "ddp"),
    ("mixtral", "zero3 ep=2"),
    ("gpt", "ddp ep=2"),
    ("collapsed", "ddp"),
    ("all_to_all", ""),
    ("mixtral", "zero3 cp=2"),
)


def routing_job() -> dict:
    """Every case at world 2 (rank 0 returns them)."""
    from helpers.cases import each_case

    def run(_i: int, case: tuple[str, str]) -> dict:
        name, strategy = case
        if name == "all_to_all":
            return all_to_all_case()
        if name == "collapsed":
            return train(name, strategy, every=1, persist=2)
        return train(name, strategy)

    return each_case(CASES, run, key=lambda case: case)
