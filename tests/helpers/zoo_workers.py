"""The zoo x strategy job: every case of one world size in one launched job, on one process group.

Each case trains a zoo model under a strategy for ``STEPS`` optimizer steps on global batches of
``replicas x PER_RANK`` samples, saving after ``STEPS - 1`` steps; then a fresh ``Parallel`` loads that checkpoint
into a fresh model and takes the last step again. Rank 0 returns, per case, the final full state dict, how far the
resumed run ended from the uninterrupted one, and whether the optimizer held every trainable parameter once and
the ties survived ``prepare`` and ``load``.
"""

from __future__ import annotations

import functools
import os

import torch
from torch import nn

import paratrain
from helpers import packed
from helpers.cases import each_case
from helpers.zoo import SPECS
from paratrain.model import find_ties
from paratrain.model.ties import Ties
from paratrain.testing import max_abs_diff

STEPS, PER_RANK = 3, 4


def step_batch(spec, step: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    return spec.inputs(global_batch, torch.Generator().manual_seed(100 + step))


def _train(par: paratrain.Parallel, spec, model, opt, steps: range) -> None:
    size, rank = par.data_parallel_size, par.data_parallel_rank
    for s in steps:
        x, y = step_batch(spec, s, size * PER_RANK)
        x, y = x[rank * PER_RANK : (rank + 1) * PER_RANK], y[rank * PER_RANK : (rank + 1) * PER_RANK]
        with par.step(model, opt):
            x, y = x.to(par.device), y.to(par.device)
            if spec.labels:
                par.forward_backward(model, x, {"labels": y})
            else:
                par.forward_backward(model, x, y, spec.loss)


def _audit(par: paratrain.Parallel, model: nn.Module, opt: torch.optim.Optimizer, ties: tuple) -> str:
    """'' when the optimizer holds each trainable parameter of this rank exactly once and the ties hold."""
    held = [id(p) for g in opt.param_groups for p in g["params"]]
    trainable = {id(p) for p in par.unwrap(model).parameters() if p.requires_grad}
    if len(held) != len(set(held)):
        return "a parameter is in the optimizer twice"
    if set(held) != trainable:
        return f"optimizer holds {len(set(held))} parameters, the model trains {len(trainable)}"
    now = find_ties(par.unwrap(model)).groups
    if Ties(groups=ties).broken(par.unwrap(model)) or set(now) - set(ties):  # a pipeline rank holds one side of a tie
        return f"ties {now} != {ties}"
    return ""


def _prepared(strategy: str, options: dict, spec):
    par = paratrain.Parallel(strategy, monitor=False, **options)
    model = spec.build()
    ties = find_ties(model).groups
    model, opt = par.prepare(model, spec.optimizer(model))
    return par, model, opt, ties


def run_case(model_name: str, strategy: str, options: dict, folder: str) -> dict:
    spec = SPECS[model_name]
    par, model, opt, ties = _prepared(strategy, options, spec)
    problems = [_audit(par, model, opt, ties)]
    _train(par, spec, model, opt, range(STEPS - 1))
    par.save(folder)
    _train(par, spec, model, opt, range(STEPS - 1, STEPS))
    final = par.full_state_dict(model, rank0_only=False)
    par.close()

    par, model, opt, ties = _prepared(strategy, options, spec)
    par.load(folder)
    problems.append(_audit(par, model, opt, ties))
    _train(par, spec, model, opt, range(STEPS - 1, STEPS))
    resumed = par.full_state_dict(model, rank0_only=False)
    par.close()
    return {"state": final, "resumed": max_abs_diff(final, resumed), "problems": [p for p in problems if p]}


def run_cases(cases: list[tuple[str, str, dict]], tmp: str) -> dict[str, dict]:
    """Every case in order; a case that raises is reported with its one-line error instead of stopping the rest
    (all ranks raise alike in prepare, where refusals happen). A model named ``packed_<name>`` trains on packed
    documents (:mod:`helpers.packed`)."""
    return each_case(cases, lambda i, c: _runner(c[0])(*c, os.path.join(tmp, str(i))), key=_case_key)


def _case_key(case: tuple[str, str, dict]) -> str:
    return f"{case[0]}/{case[1]}{case[2] or ''}"


def _runner(model_name: str):
    if model_name.startswith("packed_"):
        return lambda name, *rest: packed.run_packed(name.removeprefix("packed_"), *rest)
    return run_case


# fp32 tolerance: the parallel runs sum the same gradients in another order (all-reduce, reduce-scatter); over 3
# steps that moves parameters by a few 1e-7 (SGD) and a few 1e-6 (AdamW, whose update divides by sqrt(v)).
TOL = 2e-5
MICRO = 4  # the pipelines' default micro-batches


@functools.cache
def reference(
    model_name: str, replicas: int, slices: int | None = None, microbatches: int = 1
) -> dict[str, torch.Tensor]:
    """One process, ``STEPS`` steps on global batches of ``replicas x PER_RANK``, each cut into ``slices`` forward
    passes (default: one per replica and micro-batch); buffers (BatchNorm's running statistics) follow replica 0's
    ``microbatches`` forwards, as rank 0's do. Computed once per arguments in a test process (many cases compare with
    the same one): read it, never change it."""
    spec = SPECS[model_name]
    model = spec.build()
    opt = spec.optimizer(model)
    buffers = dict(model.named_buffers())
    slices = slices or replicas * microbatches
    size = replicas * PER_RANK // slices
    for s in range(STEPS):
        x, y = step_batch(spec, s, replicas * PER_RANK)
        kept = None
        for r in range(slices):
            sl = slice(r * size, (r + 1) * size)
            (spec.loss(spec.forward(model, x[sl], y[sl]), y[sl]) / slices).backward()
            if r == microbatches - 1:
                kept = {k: v.clone() for k, v in buffers.items()}
        for k, v in buffers.items():  # rank 0's running statistics
            v.copy_(kept[k])
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
