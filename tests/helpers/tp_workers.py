"""The tensor-parallel job: every case of one world size in one launched job, on one process group.

A case trains a zoo model (tests/helpers/zoo.py) under a layout for ``STEPS`` optimizer steps on global batches of
``BATCH`` samples, each replica taking its slice and cutting it into ``accumulate`` micro-batches; it saves after
``STEPS - 1`` steps, and a fresh ``Parallel`` — the same layout, or ``resume_as`` another one (another tp degree) —
loads that checkpoint and takes the last step again. Rank 0 returns, per case, the full state at the save and at the
end, how far the resumed run ended from the uninterrupted one, the gradient norms, what the loss received (the
logits' type and placements), and the logits a direct ``model(x)`` call returns.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch

import paratrain
from helpers.cases import each_case
from helpers.zoo import ZOO
from paratrain.model import find_blocks, find_ties
from paratrain.strategies import auto
from paratrain.testing import max_abs_diff

STEPS, BATCH = 3, 4


def step_batch(spec, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return spec.inputs(BATCH, torch.Generator().manual_seed(100 + step))


@contextmanager
def _memory_per_rank(gib: float | None) -> Iterator[None]:
    """``strategy="auto"`` plans for ``gib`` of memory per rank instead of this host's RAM."""
    if gib is None:
        yield
        return
    real = auto.local_cluster

    def tight(*args: Any) -> Any:
        cluster = real(*args)
        return replace(cluster, device=replace(cluster.device, memory_gib=gib))

    auto.local_cluster = tight
    try:
        yield
    finally:
        auto.local_cluster = real


def _before_the_model(par: paratrain.Parallel) -> list[str]:
    """What the data-parallel view answers before ``prepare`` has seen the model: under ``auto`` the layout is not
    chosen yet, so each is refused in one line instead of answering for ddp's layout."""
    answers = []
    for ask in (
        lambda: par.data_parallel_size,
        lambda: par.mean(1.0),
        lambda: par.prepare_loader(torch.utils.data.DataLoader(list(range(8)), batch_size=2)),
    ):
        try:
            answers.append(f"answered {ask()!r}")
        except paratrain.ConfigError as err:
            answers.append(str(err))
    return answers


def _prepared(model_name: str, strategy: str, options: dict, early: list[str] | None = None):
    spec = ZOO[model_name]
    options = dict(options)
    with _memory_per_rank(options.pop("memory_gib", None)):
        par = paratrain.Parallel(strategy, monitor=False, **options)
        if early is not None:
            early.extend(_before_the_model(par))
        model = spec.build()
        ties = find_ties(model).groups
        model, opt = par.prepare(model, spec.optimizer(model))
    if find_ties(par.unwrap(model)).groups != ties:
        raise AssertionError(f"ties {find_ties(par.unwrap(model)).groups} != {ties}")
    return spec, par, model, opt


def _train(spec, par, model, opt, steps: range, seen: list[str]) -> list[float]:
    size, rank, k = par.data_parallel_size, par.data_parallel_rank, par.accumulate
    per = BATCH // size

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        logits = out.logits if hasattr(out, "logits") else out
        seen.append(f"{type(logits).__name__}{tuple(getattr(logits, 'placements', ()))}")
        return spec.loss(out, target)

    norms = []
    for s in steps:
        x, y = step_batch(spec, s)
        x, y = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        for i in range(k):
            micro = slice(i * per // k, (i + 1) * per // k)
            with par.step(model, opt):
                par.forward_backward(model, x[micro].to(par.device), y[micro].to(par.device), loss_fn)
        norms.append(par.last_grad_norm)
    return norms


def run_case(
    model_name: str, strategy: str, options: dict, folder: str, resume_as: tuple[str, dict] | None = None
) -> dict[str, Any]:
    early: list[str] = []
    spec, par, model, opt = _prepared(model_name, strategy, options, early if strategy == "auto" else None)
    layout = par.strategy.describe()
    seen: list[str] = []
    norms = _train(spec, par, model, opt, range(STEPS - 1), seen)
    par.save(folder)
    saved = par.full_state_dict(model, rank0_only=False)
    norms += _train(spec, par, model, opt, range(STEPS - 1, STEPS), seen)
    final = par.full_state_dict(model, rank0_only=False)
    with warnings.catch_warnings(record=True) as caught:  # FSDP2 warned once per rank of a root returning a view
        warnings.simplefilter("always")
        logits = model(step_batch(spec, 0)[0].to(par.device))
    logits = logits.logits if hasattr(logits, "logits") else logits
    blocks = _blocks(par.unwrap(model))
    par.close()

    spec, par, model, opt = _prepared(model_name, *(resume_as or (strategy, options)))
    par.load(folder)
    _train(spec, par, model, opt, range(STEPS - 1, STEPS), [])
    resumed = par.full_state_dict(model, rank0_only=False)
    par.close()
    return {
        "layout": layout,
        "saved": saved,
        "state": final,
        "resumed": max_abs_diff(final, resumed),
        "norms": norms,
        "seen": sorted(set(seen)),
        "early": early,
        "warned": [str(w.message) for w in caught],
        "dp": par.data_parallel_size,
        "blocks": blocks,
        "logits_type": type(logits).__name__,
        "logits": logits.detach().cpu(),
    }


def _blocks(model: torch.nn.Module) -> dict[str, bool]:
    """Whether every repeated block is compiled, and checkpointed (its forward replaced by the recomputing one)."""
    blocks = find_blocks(model)
    modules = blocks.modules(model) if blocks is not None else []
    return {
        "compiled": bool(modules) and all(getattr(b, "_compiled_call_impl", None) is not None for b in modules),
        "checkpointed": bool(modules) and all("forward" in vars(b) for b in modules),
    }


def run_cases(cases: list[tuple], tmp: str) -> dict[str, dict]:
    """Every case in order, keyed ``model/strategy{options}`` (and ``->resume layout``); a case that raises a
    paratrain error is reported with its one-line message (every rank refuses alike, in ``prepare``)."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = 1  # compiled cases: no worker pool outliving the job
    return each_case(
        cases, lambda i, c: run_case(*c[:3], os.path.join(tmp, str(i)), *c[3:]), key=lambda c: case_key(*c)
    )


def case_key(model_name: str, strategy: str, options: dict, resume_as: tuple[str, dict] | None = None) -> str:
    key = f"{model_name}/{strategy}{options or ''}"
    return key + (f"->{resume_as[0]}{resume_as[1] or ''}" if resume_as else "")
