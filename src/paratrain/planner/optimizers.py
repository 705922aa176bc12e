"""The user's optimizer as the planner models it: how many parameter-sized state tensors it keeps, and which of
the planner's optimizers (``training.OPTIMIZER_STATES``: none, one or two states) plans its memory.

``strategy="auto"`` may have to plan before it is given the optimizer; it then assumes AdamW, and its messages
say that they assume it rather than name an optimizer the user may not have.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from .training import OPTIMIZER_BY_STATES

ASSUMED = "adamw"
"""What is planned when the optimizer is not known: the most common choice, and the most memory of the usual ones."""


def _sgd(g: Mapping[str, Any]) -> int:
    return 1 if g.get("momentum", 0) else 0


def _adam(g: Mapping[str, Any]) -> int:
    return 3 if g.get("amsgrad", False) else 2


def _rmsprop(g: Mapping[str, Any]) -> int:
    return 1 + (1 if g.get("momentum", 0) else 0) + (1 if g.get("centered", False) else 0)


STATE_TENSORS: Mapping[type, Callable[[Mapping[str, Any]], int]] = MappingProxyType(
    {
        torch.optim.SGD: _sgd,  # momentum_buffer
        torch.optim.Adam: _adam,  # exp_avg, exp_avg_sq (+ max_exp_avg_sq)
        torch.optim.AdamW: _adam,
        torch.optim.Adamax: lambda g: 2,  # exp_avg, exp_inf
        torch.optim.NAdam: lambda g: 2,
        torch.optim.RAdam: lambda g: 2,
        torch.optim.Adadelta: lambda g: 2,  # square_avg, acc_delta
        torch.optim.Rprop: lambda g: 2,  # prev, step_size
        torch.optim.Adagrad: lambda g: 1,  # sum
        torch.optim.ASGD: lambda g: 1,  # ax (eta and mu are scalars)
        torch.optim.RMSprop: _rmsprop,  # square_avg (+ momentum_buffer, grad_avg)
    }
)
"""Parameter-sized tensors each optimizer keeps per parameter, from one parameter group's settings."""


def state_tensors(optimizer: torch.optim.Optimizer) -> int | None:
    """The parameter-sized state tensors ``optimizer`` keeps per parameter (the most any of its groups keeps);
    None for a class not listed in :data:`STATE_TENSORS` (nor derived from one)."""
    count = next((STATE_TENSORS[c] for c in type(optimizer).__mro__ if c in STATE_TENSORS), None)
    return None if count is None else max(count(g) for g in optimizer.param_groups)


@dataclass(frozen=True, kw_only=True)
class PlannedOptimizer:
    key: str
    """The planner's optimizer (``Training.optimizer``) whose memory and step are planned."""
    states: str
    """The states planned, in words that name the user's optimizer or say what is assumed."""
    step: str
    """The optimizer step timed, in the same spirit: "the SGD step alone", "the optimizer step alone, AdamW's
    assumed"."""


def planned(optimizer: torch.optim.Optimizer | None) -> PlannedOptimizer:
    """How the planner models ``optimizer``: by its number of states; AdamW, said to be assumed, when it is None
    or of a class whose states are not known."""
    if optimizer is None:
        return PlannedOptimizer(
            key=ASSUMED,
            states="assuming AdamW's 2 optimizer states per parameter",
            step="the optimizer step alone, AdamW's assumed",
        )
    name, n = type(optimizer).__name__, state_tensors(optimizer)
    if n is None:
        return PlannedOptimizer(
            key=ASSUMED,
            states=f"assuming AdamW's 2 optimizer states per parameter ({name}'s are not known to the planner)",
            step=f"the {name} step alone, timed as AdamW's",
        )
    key = "adamw" if isinstance(optimizer, torch.optim.AdamW) and n == 2 else OPTIMIZER_BY_STATES.get(n, "adam")
    states = (
        f"with {name}, which keeps no optimizer state"
        if n == 0
        else f"with {name}'s {n} optimizer state{'' if n == 1 else 's'} per parameter"
    )
    return PlannedOptimizer(key=key, states=states + (", planned as 2" if n > 2 else ""), step=f"the {name} step alone")
