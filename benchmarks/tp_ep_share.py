"""Expert time per rank under ``Parallel("zero3", tp=2, ep=2)`` at world 4 (CPU, gloo): each tp rank computing every
row of its group's experts (``whole``: the layout before, the ep step given no tp mesh) against each computing its
half of them and gathering the outputs over tp (``share``: :mod:`paratrain.distributed.expert_parallel.tp_share`).

    .venv/bin/python benchmarks/tp_ep_share.py                       # 5 interleaved rounds of 4 steps
    .venv/bin/python benchmarks/tp_ep_share.py --rounds 1 --steps 2  # a quick look
    .venv/bin/python benchmarks/tp_ep_share.py --width 1024          # wider experts: more of the step is theirs

Model and batch: benchmarks/expert_parallel.py's (our GPT, 2 blocks x 128, 8 experts of top 2, width 256 unless
``--width``, each tp group a batch of 8 x 128 tokens; fp32, AdamW). Both subjects are built in one job and run in
every round, their order rotating. Figures, each the median over rounds of the slowest rank's median step: the time
inside the experts modules (forward: from their call to their output, the all-to-alls and, under ``share``, the
gather over tp included; backward: from their output's gradient to their inputs'), the whole step, and the rows a
rank sends to its experts per call (the planner's ``tokens_per_rank`` beside it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import time
from collections.abc import Iterator
from unittest import mock

import expert_parallel
import torch
import torch.distributed as dist
from expert_parallel import BATCH, build, one_step
from torch import nn

import paratrain
from paratrain.distributed.expert_parallel import experts as ep_experts
from paratrain.distributed.expert_parallel.part import ExpertParallel
from paratrain.distributed.process_group import finish_group
from paratrain.model.experts import find_expert_layers

SUBJECTS = ("whole", "share")


@contextlib.contextmanager
def whole_to_tp() -> Iterator[None]:
    """The layout before: the ep step is given no tp mesh, so each tp rank computes every row of its group."""
    original = ExpertParallel.step

    def step(self: ExpertParallel, *args: object, **kwargs: object) -> object:
        return original(self, *args, **{**kwargs, "tp": None})

    with mock.patch.object(ExpertParallel, "step", step):
        yield


class ExpertClock:
    """Seconds spent inside a model's experts modules, forward and backward, and the rows each call sends."""

    def __init__(self, model: nn.Module) -> None:
        self.forward = self.backward = 0.0
        self._start: dict[str, float] = {}
        for layer in find_expert_layers(model):
            m = layer.module
            m.register_forward_pre_hook(lambda *_: self._begin("f"))
            m.register_forward_hook(lambda *_: self._end("f"))
            m.register_full_backward_pre_hook(lambda *_: self._begin("b"))
            m.register_full_backward_hook(lambda *_: self._end("b"))

    def _begin(self, kind: str) -> None:
        self._start[kind] = time.perf_counter()

    def _end(self, kind: str) -> None:
        seconds = time.perf_counter() - self._start.pop(kind)
        if kind == "f":
            self.forward += seconds
        else:
            self.backward += seconds


@contextlib.contextmanager
def counted_rows() -> Iterator[list[int]]:
    """Within it, the rows each experts call sends to its experts (its tp share under ``share``)."""
    sent: list[int] = []
    original = ep_experts.exchange

    def exchange(rows: torch.Tensor, *rest: object) -> torch.Tensor:
        sent.append(len(rows))
        return original(rows, *rest)

    with mock.patch.object(ep_experts, "exchange", exchange):
        yield sent


def prepared(subject: str) -> tuple[object, nn.Module, torch.optim.Optimizer, ExpertClock]:
    model = build()
    with whole_to_tp() if subject == "whole" else contextlib.nullcontext():
        par = paratrain.Parallel("zero3", monitor=False, tp=2, ep=2)
        model, opt = par.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return par, model, opt, ExpertClock(par.unwrap(model))


def widen(width: int) -> None:
    """The model's experts ``width`` wide (benchmarks/expert_parallel.py's model otherwise)."""
    cfg = expert_parallel.CFG
    expert_parallel.CFG = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, ffn=width))


def job(rounds: int, steps: int, warmup: int, width: int) -> dict:
    widen(width)
    cfg = expert_parallel.CFG
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    g = torch.Generator().manual_seed(dist.get_rank() // 2)  # a tp group reads one batch
    ids = torch.randint(0, cfg.vocab, (BATCH, cfg.seq_len + 1), generator=g)
    x, y = ids[:, :-1], ids[:, 1:]
    subjects = {s: prepared(s) for s in SUBJECTS}
    out: dict = {s: {"expert_ms": [], "forward_ms": [], "backward_ms": [], "step_ms": []} for s in SUBJECTS}
    for s, (par, model, opt, _) in subjects.items():
        with counted_rows() as sent:
            out[s]["first_loss"] = one_step(par, model, opt, x, y)
        out[s]["rows"] = sent
        for _ in range(warmup - 1):
            one_step(par, model, opt, x, y)
    for r in range(rounds):
        for s in SUBJECTS[r % 2 :] + SUBJECTS[: r % 2]:
            par, model, opt, clock = subjects[s]
            forward, backward, total = [], [], []
            for _ in range(steps):
                dist.barrier()
                clock.forward = clock.backward = 0.0
                start = time.perf_counter()
                one_step(par, model, opt, x, y)
                total.append(time.perf_counter() - start)
                forward.append(clock.forward)
                backward.append(clock.backward)
            for key, values in (("forward_ms", forward), ("backward_ms", backward), ("step_ms", total)):
                out[s][key].append(1e3 * statistics.median(values))
            out[s]["expert_ms"].append(out[s]["forward_ms"][-1] + out[s]["backward_ms"][-1])
    for par, *_ in subjects.values():
        par.close()
    finish_group()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (at least 1)")
    p.add_argument("--width", type=int, default=expert_parallel.CFG.moe.ffn, help="the experts' width")
    a = p.parse_args()
    from paratrain.planner.expert_parallel import tokens_per_rank
    from paratrain.planner.transformer import transformer_stats

    ranks = paratrain.launch(job, 4, (a.rounds, a.steps, a.warmup, a.width), timeout_s=1800)
    widen(a.width)
    cfg = expert_parallel.CFG
    stats = transformer_stats(cfg, name="gpt-moe")
    print(
        f"world 4, zero3 tp=2 ep=2: GPT {cfg.layers} x {cfg.hidden}, {cfg.moe.experts} experts top {cfg.moe.top_k} "
        f"(width {cfg.moe.ffn}), {BATCH} x {cfg.seq_len} tokens a tp group, fp32, AdamW; {a.rounds} rounds x "
        f"{a.steps} steps; ms: median over rounds of the slowest rank's median step"
    )
    print(
        f"{'subject':<8} {'experts ms':>10} {'fwd ms':>7} {'bwd ms':>7} {'step ms':>8} {'rows/call':>9} "
        f"{'planned':>8} {'first loss':>11}  experts ms by round"
    )
    for s in SUBJECTS:
        slowest = {
            key: [max(rank[s][key][r] for rank in ranks) for r in range(a.rounds)]
            for key in ("expert_ms", "forward_ms", "backward_ms", "step_ms")
        }
        med = {key: statistics.median(v) for key, v in slowest.items()}
        rows = sorted({n for rank in ranks for n in rank[s]["rows"]})
        planned = tokens_per_rank(stats, BATCH, tp=2 if s == "share" else 1)
        print(
            f"{s:<8} {med['expert_ms']:>10.1f} {med['forward_ms']:>7.1f} {med['backward_ms']:>7.1f} "
            f"{med['step_ms']:>8.1f} {'/'.join(map(str, rows)):>9} {planned:>8.0f} {ranks[0][s]['first_loss']:>11.6f}"
            f"  {[round(v, 1) for v in slowest['expert_ms']]}"
        )


if __name__ == "__main__":
    main()
