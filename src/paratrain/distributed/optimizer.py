"""Re-creating the user's optimizer over new parameter objects (sharded or wrapped), keeping its settings."""
from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError


def param_groups_for(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module, *,
                     subset: bool = False) -> list[dict[str, Any]]:
    """The optimizer's param groups (same hyper-parameters) pointing at ``model``'s current parameters.

    With ``subset`` (a pipeline rank holds only its stages) parameters that ``model`` lacks are left out.
    """
    if any(optimizer.state.values()):
        raise ConfigError("the optimizer already has state; call prepare() before the first step and before loading "
                          "optimizer state")
    current = dict(model.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        try:
            params = [current[names[id(p)]] for p in group["params"] if not subset or names.get(id(p)) in current]
        except KeyError:
            raise ConfigError("the optimizer holds parameters that are not in the prepared model; build it from "
                              "model.parameters() of the model passed to prepare()") from None
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return groups


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its class's constructor accepts (AdamW's include one it does not)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def rebuild(optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module, *,
            subset: bool = False) -> torch.optim.Optimizer:
    """A new optimizer of the same class and settings over ``model``'s current parameters."""
    groups = [g for g in param_groups_for(optimizer, names, model, subset=subset) if g["params"]]
    if not groups:  # torch refuses an optimizer over nothing ("optimizer got an empty parameter list")
        raise ConfigError("this rank's part of the model holds no parameter the optimizer trains (a pipeline stage of "
                          "frozen layers); move the split points so that every stage trains something, or use fewer "
                          "stages")
    return type(optimizer)(groups, **constructor_defaults(optimizer))
