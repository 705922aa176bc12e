"""Model and optimizer state as torch.distributed.checkpoint (DCP) saves it.

Keys are the parameter names of the user's module (no ``module.`` or FSDP prefixes); the optimizer's state is
flattened per parameter (``state.<name>.exp_avg``, ``param_groups.<name>.lr``), so it does not depend on how
parameters are grouped or partitioned. Sharded tensors (FSDP's DTensors) stay sharded: each rank writes what it
holds, and a load onto another world size or strategy takes whatever slice each rank now needs. A rank that
holds only part of the model (a pipeline stage, a ZeRO-1 partition of the optimizer) saves and loads that part.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_OPTIM = StateDictOptions(flatten_optimizer_state_dict=True)


def model_state(module: nn.Module) -> dict[str, Any]:
    """``module``'s parameters and buffers by name, as this rank holds them."""
    return get_model_state_dict(module)


def load_model_state(module: nn.Module, state: dict[str, Any]) -> None:
    """Copy a loaded ``model_state`` into ``module`` in place (the optimizer keeps its parameter objects)."""
    set_model_state_dict(module, state)


def optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer``'s state and hyper-parameters per parameter name of ``module``.

    An optimizer that has not stepped yet gets its state created first (DCP steps it once with zero gradients
    and a zero learning rate), so the result can also serve as the template a checkpoint is loaded into.
    """
    return get_optimizer_state_dict(module, optimizer, options=_OPTIM)


def load_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put a loaded ``optimizer_state`` into ``optimizer``."""
    set_optimizer_state_dict(module, optimizer, state, options=_OPTIM)


def hyperparameters(groups: list[dict[str, Any]], names: dict[int, str]) -> dict[str, Any]:
    """Every parameter's group settings under the flattened keys DCP uses (``param_groups.<name>.<key>``)."""
    return {
        f"param_groups.{names[id(p)]}.{k}": v
        for group in groups
        for p in group["params"]
        for k, v in group.items()
        if k != "params"
    }
