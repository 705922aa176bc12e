"""``strategy="auto"``: the layout chosen once, when ``prepare`` first sees the model, before any mesh exists.

Every rank plans from the same numbers: the least memory any rank has (``least``, a collective ``Parallel``
passes in), so ranks with different GPUs or free RAM still choose alike. The planner's choice
(:func:`paratrain.planner.auto.choose`) is ddp, the least ZeRO stage that fits, that over groups of cp ranks
splitting each sequence when the model states fit but the loader's activations do not (the option ``cp=``), or
zero3 over groups of tp ranks when even zero3 does not fit and the model's tensor-parallel shape is known.
``Parallel`` then checks that the ranks agree on it and builds the mesh for it; until then the data-parallel view
(loaders, ``mean``) has no layout to follow and refuses in one line (:data:`BEFORE_THE_MODEL`).

A model with mixture-of-experts layers (:func:`paratrain.model.experts.has_experts`) lets the planner weigh expert
parallelism; when it picks ep ranks, the strategy is asked for them with its ``ep=`` option.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from ..distributed.metrics import least
from ..env import ClusterEnv
from ..model.experts import has_experts
from ..planner.auto import (
    AutoChoice,
    choose,
    local_cluster,
    processes_vs_threads,
    settle,
)
from ..rank_agreement import check_ranks_agree
from .base import Strategy
from .registry import create
from .tp_shape import model_shape

BEFORE_THE_MODEL = (
    "strategy 'auto' chooses the layout when prepare() sees the model, and the data's shards and "
    "metrics follow that layout; prepare the model first (par.prepare(model, optimizer, loader)), "
    "then loaders, mean and sum"
)


def loader_batch(loader: Any) -> tuple[int, int | None] | None:
    """(samples a rank's step reads, tokens a sample or None) of the loader ``prepare`` was given with the model,
    read from its ``batch_size`` and its dataset's first sample (a map-style dataset's ``[0]``: nothing is
    iterated); None without a loader or a batch size."""
    size = getattr(loader, "batch_size", None)
    if not isinstance(size, int) or size < 1:
        return None
    try:
        sample = loader.dataset[0]
    except Exception:  # an iterable dataset, or one that cannot be indexed: the model's context is planned
        return size, None
    if isinstance(sample, dict):
        sample = sample.get("input_ids", next(iter(sample.values()), None))
    elif isinstance(sample, (tuple, list)) and sample:
        sample = sample[0]
    tokens = sample.shape[-1] if isinstance(sample, torch.Tensor) and sample.dim() >= 1 else None
    return size, tokens


def choose_strategy(
    model: nn.Module,
    env: ClusterEnv,
    device: torch.device,
    precision: str,
    least: Callable[[float], float],
    optimizer: torch.optim.Optimizer | None = None,
    loader: Any = None,
) -> tuple[Strategy, list[str]]:
    """The strategy ``auto`` picks for ``model`` on this job, and the lines that say which and why (rank 0 prints
    them). ``least(x)``: the minimum of ``x`` over the ranks. ``optimizer``: the user's, when ``prepare`` was
    given it with the model; its states are planned, else AdamW's are assumed (and the lines say so). ``loader``:
    the one ``prepare`` was given with the model; its batch's activations are planned (``loader_batch``)."""
    cluster = local_cluster(device, env.world_size, env.local_world_size)
    cluster = replace(cluster, device=replace(cluster.device, memory_gib=least(cluster.device.memory_gib)))
    batch = loader_batch(loader)
    experts = has_experts(model)
    choice = choose(model, cluster, precision, ep=experts, cp=True, optimizer=optimizer, batch=batch)
    # tp keeps a mixture of experts whole on every rank of its group (the planner would count them split): ep, not tp
    if not choice.fits and not experts and (shape := model_shape(model)) is not None:
        choice = choose(model, cluster, precision, tp=shape, cp=True, optimizer=optimizer, batch=batch)
    choice = settle(choice, precision)  # nothing fits: refused, unless within the planner's error
    strategy = create(choice.strategy, **strategy_options(choice))
    strategy.validate(env)
    warning = "" if choice.fits else "warning: "
    lines = [f"paratrain: {warning}strategy 'auto' chose {choice.describe()}: {choice.reason}"]
    if device.type == "cpu":
        lines.append(f"paratrain: note: {processes_vs_threads(model, cluster, precision, choice.strategy, optimizer)}")
    return strategy, lines


def strategy_options(choice: AutoChoice) -> dict[str, int]:
    """The options that ask ``choice``'s strategy for the split it chose: ``tp=``, ``ep=`` and ``cp=`` degrees above
    1."""
    return {name: degree for name, degree in (("tp", choice.tp), ("ep", choice.ep), ("cp", choice.cp)) if degree > 1}


def agree_on_strategy(
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    env: ClusterEnv,
    device: torch.device,
    precision: str,
    say: Callable[[str], None],
    loader: Any = None,
) -> Strategy:
    """:func:`choose_strategy` from the least memory over the ranks, checked to be the same choice on every rank
    (collective); ``say`` prints which and why."""
    strategy, lines = choose_strategy(
        model, env, device, precision, lambda value: least(value, device), optimizer, loader
    )
    check_ranks_agree({"strategy 'auto' chose": strategy.describe()}, env.rank, env.world_size)
    for line in lines:
        say(line)
    return strategy
