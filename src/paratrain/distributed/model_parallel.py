"""Layer-split model parallelism inside one process: each layer on its stage's device, inputs moved along.

The stages are the one cutter's (:mod:`paratrain.model.cuts`); the ``model_parallel`` strategy
(:mod:`paratrain.strategies.model_parallel`) chooses the devices and wraps the staged model in DDP across processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_map

from ..model.cuts import layers, placement
from ..model.facts import ModelFacts
from ..model.materialize import to_device


def apply_model_parallel(
    model: nn.Module, devices: Sequence[torch.device], split: Sequence[int], facts: ModelFacts | None = None
) -> nn.Module:
    """Place each layer on its stage's device and move inputs along with forward pre-hooks.

    Layers that share a parameter (a tied embedding and output head) must sit on one device, since one tensor
    lives on one device: they all go to the stage of the last of them, so the model's output still comes from
    the last stage.
    """
    named = layers(model, facts)
    stage = placement(model, split, facts)
    to_device(model, devices[0])  # root parameters and buffers stay on the first stage
    for (_, layer), s in zip(named, stage):
        device = devices[s]
        to_device(layer, device)
        layer.register_forward_pre_hook(_mover(device), with_kwargs=True)
    return model


def _mover(device: torch.device) -> Callable[[nn.Module, tuple, dict], tuple[Any, Any]]:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[Any, Any]:
        move = lambda x: x.to(device) if isinstance(x, torch.Tensor) else x  # noqa: E731
        return tree_map(move, args), tree_map(move, kwargs)

    return hook
