"""Splitting a model's layers over a tensor-parallel mesh with PyTorch's ``parallelize_module``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from ...errors import ConfigError
from ...model.ties import Ties, find_ties
from .outputs import ShardedOutputs
from .plans import TPPlan
from .styles import Replicated, VocabHead


def apply_tp(
    model: nn.Module,
    mesh: DeviceMesh,
    plan: TPPlan,
    outputs: ShardedOutputs,
    styles: list[tuple[str, ParallelStyle]] | None = None,
    ties: Ties | None = None,
    leave: Sequence[nn.Module] = (),
) -> nn.Module:
    """Split ``model`` in place over the 1-D ``mesh`` by ``plan`` (or by ``styles``, the plan resolved for a
    pipeline stage: :func:`~paratrain.distributed.tensor_parallel.stage_styles.stage_styles`); every parameter ends a
    DTensor on ``mesh`` but those of ``leave``, modules another part lays out (the routed experts expert parallelism
    splits), which stay plain and whole. ``ties``: ``model``'s, when ``prepare`` found them.

    Ties survive: ``parallelize_module`` gives each module a parameter of its own, so a tied embedding and head
    are tied again to one DTensor (their plans shard both ``Shard(0)``: one sharding, one gradient).
    """
    degree = mesh.size()
    for what, size in plan.divisible(model).items():
        if size % degree:
            raise ConfigError(
                f"{plan.name}: {what}={size} does not split over tp={degree}; choose a tp that divides {size}"
            )
    ties = ties if ties is not None else find_ties(model)
    left = {id(module) for module in leave}
    for name, style in plan.per_module(model) if styles is None else styles:
        if id(model.get_submodule(name)) in left:
            raise ConfigError(f"{plan.name} splits {name}, whose experts ep splits; leave {name} out of tp_plan")
        parallelize_module(model.get_submodule(name), mesh, style)
        if isinstance(style, VocabHead):
            outputs.install_head(model.get_submodule(name))
    _check_ties(model, ties.groups)
    for module in model.modules():  # what the plan left whole: replicated, so every parameter is a DTensor
        if id(module) not in left and any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            Replicated()._apply(module, mesh)
    _retie(model, ties.groups)
    plan.adjust(model, degree)
    if plan.sequence_parallel:
        model.register_forward_pre_hook(lambda m, args: _check_sequence(args, degree))
    outputs.install(model)
    return model


def _check_ties(model: nn.Module, groups: tuple[tuple[str, ...], ...]) -> None:
    """A plan splits both modules of a tie alike, or neither (what it leaves out is replicated, the tie whole)."""
    for group in groups:
        params = [(name, model.get_parameter(name)) for name in group]
        split = [(n, p.placements) for n, p in params if isinstance(p, DTensor)]
        whole = [n for n, p in params if not isinstance(p, DTensor)]
        owner = lambda n: n.rpartition(".")[0]  # noqa: E731
        if split and whole:
            raise ConfigError(
                f"tp_plan splits {owner(split[0][0])!r} but not {owner(whole[0])!r}, which shares its "
                f"weight; name both (an embedding 'rowwise', a head 'colwise') or neither"
            )
        if len({p for _, p in split}) > 1:
            raise ConfigError(
                f"tp plan splits the tied weights {split[0][0]!r} ({split[0][1]}) and {split[1][0]!r} "
                f"({split[1][1]}) differently; give both modules styles with one sharding"
            )


def _retie(model: nn.Module, groups: tuple[tuple[str, ...], ...]) -> None:
    """``parallelize_module`` (and replication) gave each module of a tie a parameter of its own: one again."""
    for group in groups:
        first = model.get_parameter(group[0])
        for name in group[1:]:
            owner, _, attr = name.rpartition(".")
            setattr(model.get_submodule(owner), attr, first)


def _check_sequence(args: tuple[Any, ...], degree: int) -> None:
    x = args[0] if args else None
    if isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[1] % degree:
        raise ConfigError(
            f"a sequence of {x.shape[1]} tokens does not split over tp={degree} (sequence parallel); "
            f"use a length divisible by {degree}"
        )
