"""Where a model is cut into contiguous stages: the one stage cutter of ``model_parallel``, ``pipeline`` and the
planner.

A model is read as a list of layers (its top-level children, containers and the path to its repeated blocks
opened up, so each block is a layer); a split is a list of cut points into that list, balanced by parameter count
unless the user gives one. Layers that share a parameter are kept on one stage.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from ..errors import ConfigError
from .structure import find_blocks
from .ties import find_ties

if TYPE_CHECKING:
    from .facts import ModelFacts


def layers(model: nn.Module, facts: ModelFacts | None = None) -> list[tuple[str, nn.Module]]:
    """The model's layers in definition order: top-level children, with containers and the modules on the way to
    the repeated blocks (a transformers model's ``transformer``/``model``) opened up, so each block is a layer.
    ``facts``: ``model``'s, when ``prepare`` found them."""
    out: list[tuple[str, nn.Module]] = []
    blocks = facts.blocks if facts is not None else find_blocks(model)
    path = blocks.container.split(".") if blocks and blocks.container else []
    opened = {".".join(path[:i]) for i in range(1, len(path) + 1)}

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            qual = f"{prefix}{name}"
            if isinstance(child, (nn.Sequential, nn.ModuleList)) or qual in opened:
                visit(qual + ".", child)
            else:
                out.append((qual, child))

    visit("", model)
    return out


def balance(sizes: Sequence[int], stages: int) -> list[int]:
    """Cut points (start indices of stages 2…k) of a contiguous split minimising the largest stage."""
    n = len(sizes)
    if stages > n:
        raise ConfigError(f"cannot cut {n} layers into {stages} stages; use at most {n} stages")
    prefix = [0]
    for s in sizes:
        prefix.append(prefix[-1] + s)
    # best[k][i]: smallest possible largest stage when the first i layers form k stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0
    for k in range(1, stages + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    points, i = [], n
    for k in range(stages, 1, -1):
        i = cut[k][i]
        points.append(i)
    return sorted(points)


def stage_of_layers(n_layers: int, split: Sequence[int]) -> list[int]:
    """Stage index of every layer given the cut points."""
    points = list(split)
    if points != sorted(set(points)) or any(not 0 < p < n_layers for p in points):
        raise ConfigError(
            f"split {list(split)} does not fit a model with {n_layers} layers: give increasing indices "
            f"between 1 and {n_layers - 1} (see paratrain.model.cuts.layers(model))"
        )
    return [sum(i >= p for p in points) for i in range(n_layers)]


def placement(model: nn.Module, split: Sequence[int], facts: ModelFacts | None = None) -> list[int]:
    """Stage of every layer of ``layers(model)`` for the cut points ``split``, tied layers moved together to the
    stage of the last of them (see :func:`paratrain.distributed.model_parallel.apply_model_parallel`)."""
    named = layers(model, facts)
    stage = stage_of_layers(len(named), split)
    index = {name: i for i, (name, _) in enumerate(named)}
    for owners in (facts.ties if facts is not None else find_ties(model)).owners():
        tied = [i for i in (_layer_of(o, index) for o in owners) if i is not None]
        for i in tied:
            stage[i] = max(stage[j] for j in tied)
    return stage


def _layer_of(module_name: str, index: dict[str, int]) -> int | None:
    """Index of the layer that is ``module_name`` or holds it."""
    parts = module_name.split(".")
    for k in range(len(parts), 0, -1):
        found = index.get(".".join(parts[:k]))
        if found is not None:
            return found
    return None


def cut_points(model: nn.Sequential, n_stages: int, split: Sequence[int] | None) -> list[int]:
    """Start index of every stage (the first is 0), validated against the model."""
    n = len(model)
    sizes = [sum(p.numel() for p in layer.parameters()) for layer in model]
    points = [0, *balance(sizes, n_stages)] if split is None else [0, *split]
    if len(points) != n_stages or points != sorted(set(points)) or points[-1] >= n:
        raise ConfigError(
            f"pipeline split {list(split or [])} does not fit: {n_stages} stages need {n_stages - 1} increasing "
            f"cut points between 1 and {n - 1} for this {n}-layer model"
        )
    trainable = [any(p.requires_grad for p in layer.parameters()) for layer in model]
    for stage, (start, end) in enumerate(zip(points, [*points[1:], n])):
        if not any(trainable[start:end]):  # checked on every rank alike, so all fail together
            raise ConfigError(
                f"pipeline stage {stage} (layers {start}..{end - 1}) holds no trainable parameter, so its rank would "
                "have nothing to optimise; move its cut points or use fewer stages"
            )
    return points
