"""Re-creating the user's optimizer over new parameter objects (sharded or wrapped), keeping its settings.

A prepared model can hold plain parameters beside DTensors (expert parallelism beside DDP or a pipeline's
replicas), or DTensors of several meshes and placements (experts on their own mesh, tensor parallelism), in one of
the user's param groups. The multi-tensor paths of torch's optimizers (``foreach``, CUDA's default, and ``fused``)
take one kind of tensor a call (:mod:`paratrain.tensor_layouts`), and they run per param group. So the step of a
re-created optimizer sees each group as one group per layout, holding that group's hyper-parameters; outside the step
the optimizer holds the user's groups unchanged, so what reads or edits them (LR schedulers, ``param_groups[i]["lr"]``,
``state_dict()`` and checkpoints at another layout) sees the groups the user built.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from ..tensor_layouts import grouped, layout_of


def param_groups_for(
    optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module, *, subset: bool = False
) -> list[dict[str, Any]]:
    """The optimizer's param groups (same hyper-parameters) pointing at ``model``'s current parameters.

    With ``subset`` (a pipeline rank holds only its stages) parameters that ``model`` lacks are left out.
    """
    if any(optimizer.state.values()):
        raise ConfigError(
            "the optimizer already has state; call prepare() before the first step and before loading optimizer state"
        )
    current = dict(model.named_parameters())
    groups = []
    for group in optimizer.param_groups:
        try:
            params = [current[names[id(p)]] for p in group["params"] if not subset or names.get(id(p)) in current]
        except KeyError:
            raise ConfigError(
                "the optimizer holds parameters that are not in the prepared model; build it from "
                "model.parameters() of the model passed to prepare()"
            ) from None
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": params})
    return groups


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's defaults that its class's constructor accepts (AdamW's include one it does not)."""
    accepted = inspect.signature(type(optimizer).__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in accepted.values()):
        return dict(optimizer.defaults)
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def rebuild(
    optimizer: torch.optim.Optimizer, names: dict[int, str], model: nn.Module, *, subset: bool = False
) -> torch.optim.Optimizer:
    """A new optimizer of the same class and settings over ``model``'s current parameters."""
    groups = [g for g in param_groups_for(optimizer, names, model, subset=subset) if g["params"]]
    if not groups:  # torch refuses an optimizer over nothing ("optimizer got an empty parameter list")
        raise ConfigError(
            "this rank's part of the model holds no parameter the optimizer trains (a pipeline stage of "
            "frozen layers); move the split points so that every stage trains something, or use fewer "
            "stages"
        )
    return step_by_layout(type(optimizer)(groups, **constructor_defaults(optimizer)))


def step_by_layout(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer``, its ``step`` taking each param group as one group per layout (see the module docstring).

    The step stays a bound method of the optimizer: torch's LR schedulers re-bind ``optimizer.step`` to count its
    calls."""
    step: Callable[..., Any] = type(optimizer).step

    @functools.wraps(step)
    def by_layout(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        with groups_by_layout(self):
            return step(self, *args, **kwargs)

    optimizer.step = MethodType(by_layout, optimizer)  # type: ignore[method-assign]
    return optimizer


@contextmanager
def groups_by_layout(optimizer: torch.optim.Optimizer) -> Iterator[None]:
    """Within it, ``optimizer.param_groups`` holds each group split by layout, the parts sharing the group's
    hyper-parameters; after it, the user's groups again, with what the step wrote into a part's settings (a
    per-group counter) written back into its group."""
    user = optimizer.param_groups
    parts = [_split(group) for group in user]
    if all(len(p) == 1 for p in parts):
        yield
        return
    before = [dict(group) for group in user]
    optimizer.param_groups = [part for split in parts for part in split]
    try:
        yield
    finally:
        optimizer.param_groups = user
        for group, old, split in zip(user, before, parts, strict=True):
            for part in split:
                group.update((k, v) for k, v in part.items() if k != "params" and old.get(k) is not v)


def _split(group: dict[str, Any]) -> list[dict[str, Any]]:
    """``group`` itself when its parameters share one layout, else one copy of its settings per layout."""
    layouts = grouped(group["params"], layout_of)
    if len(layouts) <= 1:
        return [group]
    return [{**group, "params": params} for params in layouts]
